"""Stand-ins for Triton's example sequence models, answering as NVIDIA's sequence clients
expect: `simple_sequence` answers INPUT plus 1 on a sequence's first request (INPUT alone after
it); `simple_dyna_sequence` also adds the correlation id to a sequence's last answer;
`simple_string_dyna_sequence` answers the running sum of INPUT over the sequence, plus its
(string) correlation id, read as an integer, on the last answer."""

import numpy as np
import triton_python_backend_utils as pb_utils


def _flag(request, name):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return tensor is not None and bool(tensor.as_numpy().any())


class TritonPythonModel:
    def initialize(self, args):
        self.name = args["model_name"]
        self.totals = {}

    def execute(self, requests):
        responses = []
        for request in requests:
            value = pb_utils.get_input_tensor_by_name(request, "INPUT").as_numpy()
            start, end = _flag(request, "START"), _flag(request, "END")
            answer = self._answer(request, value, start, end)
            responses.append(
                pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("OUTPUT", answer)])
            )
        return responses

    def _answer(self, request, value, start, end):
        if self.name == "simple_string_dyna_sequence":
            corrid = pb_utils.get_input_tensor_by_name(request, "CORRID").as_numpy()
            key = corrid.reshape(-1)[0]
            total = (np.zeros_like(value) if start else self.totals[key]) + value
            self.totals[key] = total
            if end:
                del self.totals[key]
                return (total + np.int32(int(key))).astype(np.int32)
            return total
        answer = value + np.int32(start)
        if self.name == "simple_dyna_sequence" and end:
            corrid = pb_utils.get_input_tensor_by_name(request, "CORRID").as_numpy()
            answer = answer + corrid.reshape(value.shape).astype(np.int32)
        return answer.astype(np.int32)
