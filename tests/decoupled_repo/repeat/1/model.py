"""Triton's repeat_int32 example, as a user would write it: one response per element of IN,
each after DELAY[i] milliseconds, sent from a thread after execute returned; WAIT
milliseconds before the final flag."""

import json
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.model_config = json.loads(args["model_config"])
        assert pb_utils.using_decoupled_model_transaction_policy(self.model_config)
        self.threads = []

    def execute(self, requests):
        for request in requests:
            thread = threading.Thread(target=self.respond, args=(request,), daemon=True)
            thread.start()
            self.threads.append(thread)
        return None

    def respond(self, request):
        values = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
        delays = pb_utils.get_input_tensor_by_name(request, "DELAY").as_numpy()
        wait = pb_utils.get_input_tensor_by_name(request, "WAIT").as_numpy()
        sender = request.get_response_sender()
        for index, (value, delay) in enumerate(zip(values, delays, strict=True)):
            if sender.is_cancelled():
                break
            time.sleep(delay / 1000)
            out = pb_utils.Tensor("OUT", np.array([value], np.int32))
            idx = pb_utils.Tensor("IDX", np.array([index], np.uint32))
            sender.send(pb_utils.InferenceResponse(output_tensors=[out, idx]))
        time.sleep(wait[0] / 1000)
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def finalize(self):
        for thread in self.threads:
            thread.join(10)
