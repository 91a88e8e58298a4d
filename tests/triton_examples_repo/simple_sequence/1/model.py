"""A sequence accumulator: OUTPUT is the running sum of INPUT over the sequence (START resets
it); `simple_dyna_sequence` adds the sequence's correlation id to each answer, as Triton's does."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.add_correlation_id = "dyna" in args["model_name"]
        self.totals = {}

    def execute(self, requests):
        responses = []
        for request in requests:
            key = request.correlation_id()
            value = pb_utils.get_input_tensor_by_name(request, "INPUT").as_numpy()
            start = pb_utils.get_input_tensor_by_name(request, "START").as_numpy()
            if start.any():
                self.totals[key] = np.zeros_like(value)
            total = self.totals.get(key, np.zeros_like(value)) + value
            self.totals[key] = total
            answer = total + np.int32(key) if self.add_correlation_id else total
            responses.append(
                pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("OUTPUT", answer)])
            )
        return responses
