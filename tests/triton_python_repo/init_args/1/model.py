# Answers with the args its initialize got, and writes a file when finalize is called.
import json
import os

import numpy as np
import triton_python_backend_utils as pb_utils
from helper import describe  # a sibling module of model.py


class TritonPythonModel:
    def initialize(self, args):
        self.args = args
        pb_utils.Logger.log_info(describe(args))

    def execute(self, requests):
        args = json.dumps(self.args).encode()
        model_dir = pb_utils.get_model_dir().encode()
        return [
            pb_utils.InferenceResponse(
                [
                    pb_utils.Tensor("ARGS", np.array([args], dtype=np.object_)),
                    pb_utils.Tensor("MODEL_DIR", np.array([model_dir], dtype=np.object_)),
                ]
            )
            for _ in requests
        ]

    def finalize(self):
        name = self.args["model_instance_name"]
        path = os.path.join(self.args["model_repository"], f"finalized-{name}")
        with open(path, "w") as done:
            done.write("finalized")
