# No inputs or outputs in config.pbtxt: auto_complete_config gives them, and batching.
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        auto_complete_model_config.add_input({"name": "IN", "data_type": "TYPE_INT64", "dims": [2]})
        auto_complete_model_config.add_output(
            {"name": "OUT", "data_type": "TYPE_INT64", "dims": [2]}
        )
        auto_complete_model_config.set_max_batch_size(4)
        auto_complete_model_config.set_dynamic_batching()
        return auto_complete_model_config

    def execute(self, requests):
        return [
            pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy() * 3)]
            )
            for r in requests
        ]
