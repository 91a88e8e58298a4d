# No config.pbtxt: auto-completed (backend from this file, tensors from the hook below).
# Sums the responses of a decoupled BLS call to square_decoupled (IN < 0: to a model that is
# not there, whose error it answers).
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(config):
        config.add_input({"name": "IN", "data_type": "TYPE_INT32", "dims": [1]})
        config.add_output({"name": "SUM", "data_type": "TYPE_INT32", "dims": [1]})
        config.add_output({"name": "COUNT", "data_type": "TYPE_INT32", "dims": [1]})
        return config

    def execute(self, requests):
        responses = []
        for request in requests:
            n = pb_utils.get_input_tensor_by_name(request, "IN")
            target = "square_decoupled" if n.as_numpy()[0] >= 0 else "absent"
            call = pb_utils.InferenceRequest(
                model_name=target, inputs=[n], requested_output_names=["OUT"]
            )
            total, count, error = 0, 0, None
            for response in call.exec(decoupled=True):
                count += 1
                if response.has_error():
                    error = response.error()
                elif response.output_tensors():
                    total += int(pb_utils.get_output_tensor_by_name(response, "OUT").as_numpy()[0])
            if error is not None:
                responses.append(pb_utils.InferenceResponse(error=error))
                continue
            outputs = [
                pb_utils.Tensor("SUM", np.array([total], np.int32)),
                pb_utils.Tensor("COUNT", np.array([count], np.int32)),
            ]
            responses.append(pb_utils.InferenceResponse(outputs))
        return responses
