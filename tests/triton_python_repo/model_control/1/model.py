# Triton's model loading API from a model: ACTION load / ready_load_ready / load_files / unload /
# unload_dependents / ready on TARGET (CONFIG: a load's config override, "" for none;
# load_files: with add_sub's model.py as the override's file); RESULT is "ok", the readiness,
# or the TritonModelException's message.
from pathlib import Path

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
                elif action == "ready_load_ready":  # Triton's example: load it unless ready
                    before = pb_utils.is_model_ready(model_name=target)
                    pb_utils.load_model(model_name=target)
                    result = f"{before}->{pb_utils.is_model_ready(model_name=target)}"
                elif action == "load_files":
                    source = Path(pb_utils.get_model_dir()).parents[1] / "add_sub" / "1"
                    files = {"file:1/model.py": (source / "model.py").read_bytes()}
                    config = _text(request, "CONFIG")
                    pb_utils.load_model(model_name=target, config=config, files=files)
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
