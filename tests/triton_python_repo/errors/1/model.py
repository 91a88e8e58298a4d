# Per-request errors with Triton's codes (MODE 1..7), a whole call failing (MODE 9), and
# contract breaches (MODE 20: not a list; 21: one response short; 22: not a response).
import numpy as np
import triton_python_backend_utils as pb_utils

CODES = {
    1: pb_utils.TritonError.INVALID_ARG,
    2: pb_utils.TritonError.NOT_FOUND,
    3: pb_utils.TritonError.UNAVAILABLE,
    4: pb_utils.TritonError.UNSUPPORTED,
    5: pb_utils.TritonError.ALREADY_EXISTS,
    6: pb_utils.TritonError.UNKNOWN,
    7: pb_utils.TritonError.INTERNAL,
}


class TritonPythonModel:
    def execute(self, requests):
        modes = [int(r.inputs()[0].as_numpy()[0][0]) for r in requests]
        if 9 in modes:
            raise pb_utils.TritonModelException("mode 9 fails the whole call")
        responses = []
        for mode in modes:
            if mode in CODES:
                error = pb_utils.TritonError(f"mode {mode} is refused", CODES[mode])
                responses.append(pb_utils.InferenceResponse(error=error))
            else:
                out = pb_utils.Tensor("OUT", np.array([[mode * 10]], np.int32))
                responses.append(pb_utils.InferenceResponse(output_tensors=[out]))
        if 20 in modes:
            return tuple(responses)
        if 21 in modes:
            return responses[1:]
        if 22 in modes:
            return ["not a response" for _ in responses]
        return responses
