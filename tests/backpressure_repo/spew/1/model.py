"""A decoupled model that answers as fast as it can: N responses of SIZE bytes each (byte i
of response k is k), then the final flag; it stops early once its request is cancelled."""

import threading

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            threading.Thread(target=self.respond, args=(request,), daemon=True).start()
        return None

    def respond(self, request):
        count = int(pb_utils.get_input_tensor_by_name(request, "N").as_numpy()[0])
        size = int(pb_utils.get_input_tensor_by_name(request, "SIZE").as_numpy()[0])
        sender = request.get_response_sender()
        for index in range(count):
            if sender.is_cancelled():
                break
            out = pb_utils.Tensor("OUT", np.full(size, index % 256, np.uint8))
            sender.send(pb_utils.InferenceResponse(output_tensors=[out]))
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
