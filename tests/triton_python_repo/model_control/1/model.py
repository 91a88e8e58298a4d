# Triton's model loading API from a model: ACTION load / unload / unload_dependents / ready on
# TARGET (CONFIG: a load's config override, "" for none); RESULT is "ok", the readiness, or
# the TritonModelException's message.
import numpy as np
import triton_python_backend_utils as pb_utils


def _text(request, name):
    return pb_utils.get_input_tensor_by_name(request, name).as_numpy()[0].decode()


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            action, target = _text(request, "ACTION"), _text(request, "TARGET")
            try:
                if action == "load":
                    pb_utils.load_model(model_name=target, config=_text(request, "CONFIG"))
                    result = "ok"
                elif action.startswith("unload"):
                    dependents = action == "unload_dependents"
                    pb_utils.unload_model(model_name=target, unload_dependents=dependents)
                    result = "ok"
                else:
                    result = str(pb_utils.is_model_ready(model_name=target))
            except pb_utils.TritonModelException as exc:
                result = str(exc)
            out = pb_utils.Tensor("RESULT", np.array([result.encode()], dtype=np.object_))
            responses.append(pb_utils.InferenceResponse([out]))
        return responses
