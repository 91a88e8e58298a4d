# Its own metrics, as Triton's custom_metrics example keeps them: a counter of the rows it ran
# and a histogram of the values it saw, created at initialize, updated by every execute.
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.rows_family = pb_utils.MetricFamily(
            name="test_rows_total", description="Rows run", kind=pb_utils.MetricFamily.COUNTER
        )
        self.rows = self.rows_family.Metric(labels={"model": "custom_metrics", "version": "1"})
        self.values_family = pb_utils.MetricFamily(
            name="test_values", description="Values seen", kind=pb_utils.MetricFamily.HISTOGRAM
        )
        self.values = self.values_family.Metric(labels={"model": "custom_metrics"}, buckets=[1, 10])

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            self.rows.increment(x.shape[0])
            for value in x.ravel():
                self.values.observe(float(value))
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x)]))
        return responses
