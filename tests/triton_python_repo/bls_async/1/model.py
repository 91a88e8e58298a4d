# BLS in the shape of Triton's examples/bls/async_model.py: two calls awaited together.
import asyncio

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    async def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            calls = [
                pb_utils.InferenceRequest(
                    model_name="scale",
                    requested_output_names=["OUTPUT__0"],
                    inputs=[
                        pb_utils.Tensor("x", x),
                        pb_utils.Tensor("scale", np.full((x.shape[0], 1), k, np.float32)),
                    ],
                ).async_exec()
                for k in (2.0, 3.0)
            ]
            twice, thrice = await asyncio.gather(*calls)
            responses.append(
                pb_utils.InferenceResponse(
                    [
                        pb_utils.Tensor("TWICE", twice.output_tensors()[0].as_numpy()),
                        pb_utils.Tensor("THRICE", thrice.output_tensors()[0].as_numpy()),
                    ]
                )
            )
        return responses
