# Decoupled: IN = n answers n responses, OUT = n-1 down to 0 (response parameter "left" the
# same), then the final flag on its own;
# IN = -1 answers one response, then an error response.
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            n = int(pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()[0])
            sender = request.get_response_sender()
            for i in reversed(range(max(n, 1))):
                out = pb_utils.Tensor("OUT", np.array([i], np.int32))
                sender.send(pb_utils.InferenceResponse([out], parameters={"left": i}))
            if n < 0:
                error = pb_utils.TritonError("below zero", pb_utils.TritonError.INVALID_ARG)
                sender.send(pb_utils.InferenceResponse(error=error))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
