"""An ordinary (not decoupled) model: its one answer is the text, with the request's
parameters appended, as JSON."""

import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            text = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy()[0]
            params = json.loads(request.parameters())
            answer = text.decode() + " " + json.dumps(params, sort_keys=True)
            out = pb_utils.Tensor("text_output", np.array([answer.encode()], np.object_))
            responses.append(pb_utils.InferenceResponse([out]))
        return responses
