"""Pre-processing step of digits_ensemble, written against Triton's Python backend API:
raw pixels 0..16 scaled to 0..1 with a channel dim, as examples/build_models.py trained digits."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            pixels = pb_utils.get_input_tensor_by_name(request, "PIXELS").as_numpy()
            image = (pixels.astype(np.float32) / 16.0)[:, np.newaxis, :, :]
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("IMAGE", image)]))
        return responses
