"""`simple_string`: `simple` over decimal strings (each element parsed as an int32)."""

import numpy as np
import triton_python_backend_utils as pb_utils


def _ints(request, name):
    return np.vectorize(int, otypes=[np.int32])(
        pb_utils.get_input_tensor_by_name(request, name).as_numpy()
    )


def _strings(values):
    return np.vectorize(lambda v: str(v).encode(), otypes=[np.object_])(values)


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            a, b = _ints(request, "INPUT0"), _ints(request, "INPUT1")
            outputs = [
                pb_utils.Tensor("OUTPUT0", _strings(a + b)),
                pb_utils.Tensor("OUTPUT1", _strings(a - b)),
            ]
            responses.append(pb_utils.InferenceResponse(output_tensors=outputs))
        return responses
