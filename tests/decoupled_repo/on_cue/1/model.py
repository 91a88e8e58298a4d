"""N tokens, the first at once and each next one only on its cue: a byte read from the FIFO
that CUES names. A client that cues a token only once it has received the one before sees
each token reach it before the next is made; the FIFO's end (no writer left) ends the tokens."""

import threading

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            threading.Thread(target=self.respond, args=(request,), daemon=True).start()
        return None

    def respond(self, request):
        cues = pb_utils.get_input_tensor_by_name(request, "CUES").as_numpy()[0].decode()
        count = int(pb_utils.get_input_tensor_by_name(request, "N").as_numpy()[0])
        sender = request.get_response_sender()
        with open(cues, "rb", buffering=0) as fifo:
            for token in range(count):
                if token and not fifo.read(1):
                    break
                out = pb_utils.Tensor("OUT", np.array([token], np.int32))
                sender.send(pb_utils.InferenceResponse([out]))
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
