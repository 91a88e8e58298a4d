# Answers with what the request says of itself: parameters, requested outputs, sequence id;
# its response parameters (bool, int, str) say the same for the client.
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            names = request.requested_output_names()
            responses.append(
                pb_utils.InferenceResponse(
                    [
                        pb_utils.Tensor(
                            "PARAMETERS", np.array([request.parameters()], dtype=np.object_)
                        ),
                        pb_utils.Tensor("REQUESTED", np.array(sorted(names), dtype=np.object_)),
                        pb_utils.Tensor(
                            "CORRELATION", np.array([request.correlation_id()], np.int64)
                        ),
                    ],
                    parameters={
                        "outputs": len(names),
                        "in_sequence": request.correlation_id() != 0,
                        "model": "params",
                    },
                )
            )
        return responses
