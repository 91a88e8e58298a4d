# Two decoupled BLS calls to square_decoupled awaited together; SUM adds every response.
import asyncio

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    async def execute(self, requests):
        responses = []
        for request in requests:
            n = pb_utils.get_input_tensor_by_name(request, "IN")
            calls = [
                pb_utils.InferenceRequest(
                    model_name="square_decoupled", inputs=[n], requested_output_names=["OUT"]
                ).async_exec(decoupled=True)
                for _ in range(2)
            ]
            total = 0
            for streamed in await asyncio.gather(*calls):
                for response in streamed:
                    if response.has_error():
                        raise pb_utils.TritonModelException(response.error().message())
                    if response.output_tensors():
                        total += int(response.output_tensors()[0].as_numpy()[0])
            responses.append(
                pb_utils.InferenceResponse([pb_utils.Tensor("SUM", np.array([total], np.int32))])
            )
        return responses
