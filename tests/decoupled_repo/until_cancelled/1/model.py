"""An `async def execute` that streams a token every 20 ms until its client goes away, then
writes the file MARKER names (what a test waits for) and sends the final flag."""

import asyncio
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    async def execute(self, requests):
        for request in requests:
            marker = pb_utils.get_input_tensor_by_name(request, "MARKER").as_numpy()[0]
            sender = request.get_response_sender()
            count = 0
            while not request.is_cancelled():
                out = pb_utils.Tensor("OUT", np.array([count], np.int32))
                sender.send(pb_utils.InferenceResponse([out]))
                count += 1
                await asyncio.sleep(0.02)
            Path(marker.decode()).write_text(str(count))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
