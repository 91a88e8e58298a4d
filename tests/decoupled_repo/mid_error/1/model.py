"""One response, then an error response, then one more response with the final flag; N < 0
makes execute raise instead, which ends the request with Triton's batch-wide message."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            n = int(pb_utils.get_input_tensor_by_name(request, "N").as_numpy()[0])
            if n < 0:
                raise pb_utils.TritonModelException("negative N")
            sender = request.get_response_sender()
            first = pb_utils.Tensor("OUT", np.array([n], np.int32))
            sender.send(pb_utils.InferenceResponse([first]))
            error = pb_utils.TritonError("out of tokens", pb_utils.TritonError.INVALID_ARG)
            sender.send(pb_utils.InferenceResponse(error=error))
            last = pb_utils.Tensor("OUT", np.array([n + 1], np.int32))
            sender.send(
                pb_utils.InferenceResponse([last]),
                flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
            )
        return None
