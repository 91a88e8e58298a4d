"""A sequence model whose step costs 2 ms whatever the batch: each execute sleeps once, then
answers every request with the running sum of INPUT over its sequence (reset on START, keyed
by the request's correlation id). A slot the direct strategy fills with READY 0 is answered
with zeros and changes no sum."""

import time

import numpy as np
import triton_python_backend_utils as pb_utils

#: what one execute costs, whatever its batch.
STEP_S = 0.002


def _flag(request, name):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return tensor is not None and bool(tensor.as_numpy().any())


class TritonPythonModel:
    def initialize(self, args):
        self.totals = {}

    def execute(self, requests):
        time.sleep(STEP_S)
        responses = []
        for request in requests:
            value = pb_utils.get_input_tensor_by_name(request, "INPUT").as_numpy()
            if _flag(request, "READY"):
                key = request.correlation_id()
                before = self.totals.get(key) if not _flag(request, "START") else None
                total = value.astype(np.int32) if before is None else before + value
                self.totals[key] = total
            else:
                total = np.zeros_like(value, dtype=np.int32)
            responses.append(
                pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("OUTPUT", total)])
            )
        return responses
