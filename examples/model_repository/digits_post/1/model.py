"""Post-processing step of digits_ensemble, written against Triton's Python backend API: the
label (from labels.txt) of each row's largest logit, as a BYTES string."""

from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        labels = Path(args["model_repository"]) / "labels.txt"
        self.labels = np.array([line.encode() for line in labels.read_text().split()], dtype=object)

    def execute(self, requests):
        responses = []
        for request in requests:
            logits = pb_utils.get_input_tensor_by_name(request, "LOGITS").as_numpy()
            label = self.labels[logits.argmax(axis=1)].reshape(-1, 1)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("LABEL", label)]))
        return responses
