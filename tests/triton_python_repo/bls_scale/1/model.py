# BLS in the shape of Triton's examples/bls/sync_model.py: each request's X goes to the
# TorchScript model named by TARGET (scale by 2), the name passed as bytes as Triton's example
# does; its error, if any, answers the request.
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            target = pb_utils.get_input_tensor_by_name(request, "TARGET").as_numpy()[0][0]
            scale = np.full((x.shape[0], 1), 2.0, np.float32)
            infer_request = pb_utils.InferenceRequest(
                model_name=target,
                requested_output_names=["OUTPUT__0"],
                inputs=[pb_utils.Tensor("x", x), pb_utils.Tensor("scale", scale)],
            )
            infer_response = infer_request.exec()
            if infer_response.has_error():
                responses.append(pb_utils.InferenceResponse(error=infer_response.error()))
                continue
            out = pb_utils.get_output_tensor_by_name(infer_response, "OUTPUT__0")
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", out.as_numpy())]))
        return responses
