"""End to end through tritonclient.http against `sluice serve` on a real Redis."""

from __future__ import annotations

import threading
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.conftest import Service, wait_until


@pytest.fixture
def client(service: Service) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(service.http_url, concurrency=16)


def _input(
    name: str, array: np.ndarray, datatype: str, binary: bool = True
) -> httpclient.InferInput:
    tensor = httpclient.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array, binary_data=binary)
    return tensor


def _batch_counts(client: httpclient.InferenceServerClient, model: str) -> dict[int, int]:
    stats = client.get_inference_statistics(model)["model_stats"][0]
    return {b["batch_size"]: b["compute_infer"]["count"] for b in stats["batch_stats"]}


def test_health_and_server_metadata(client: httpclient.InferenceServerClient) -> None:
    assert client.is_server_live()
    assert client.is_server_ready()
    meta = client.get_server_metadata()
    assert meta["name"] == "triton"  # NVIDIA's examples check it; sluice names itself in extensions
    assert meta["version"] == "2.51.0"
    assert {"binary_tensor_data", "model_configuration", "statistics"} <= set(meta["extensions"])
    assert "sluice/0.1.0" in meta["extensions"]


def test_model_metadata_and_config(client: httpclient.InferenceServerClient) -> None:
    meta = client.get_model_metadata("batch8")
    assert meta["versions"] == ["1"]
    assert meta["platform"] == "python"
    assert meta["inputs"] == [{"name": "IN", "datatype": "FP32", "shape": [-1, 4]}]
    config = client.get_model_config("batch8")
    assert config["max_batch_size"] == 8
    assert config["dynamic_batching"]["max_queue_delay_microseconds"] == 1000000
    assert config["dynamic_batching"]["preferred_batch_size"] == [8]
    assert config["input"][0]["dims"] == [4]


@pytest.mark.parametrize("binary", [True, False])
def test_infer_binary_and_json(client: httpclient.InferenceServerClient, binary: bool) -> None:
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    out = httpclient.InferRequestedOutput("OUT", binary_data=binary)
    result = client.infer(
        "named_args",
        [
            _input("x", np.ones((2, 3), np.float32), "FP32", binary),
            _input("scale", np.array([[2.0], [3.0]], np.float32), "FP32", binary),
        ],
        outputs=[httpclient.InferRequestedOutput("OUTPUT__0", binary_data=binary)],
    )
    np.testing.assert_array_equal(result.as_numpy("OUTPUT__0"), [[2, 2, 2], [3, 3, 3]])
    result = client.infer(
        "batch8", [_input("IN", x, "FP32", binary)], outputs=[out], request_id="abc"
    )
    np.testing.assert_array_equal(result.as_numpy("OUT"), x * 2)
    assert result.get_response()["id"] == "abc"


def test_every_datatype_round_trips(client: httpclient.InferenceServerClient) -> None:
    arrays = {
        "BOOL": np.array([[True, False]]),
        "UINT8": np.array([[0, 255]], np.uint8),
        "UINT16": np.array([[0, 65535]], np.uint16),
        "UINT32": np.array([[0, 2**32 - 1]], np.uint32),
        "UINT64": np.array([[0, 2**64 - 1]], np.uint64),
        "INT8": np.array([[-128, 127]], np.int8),
        "INT16": np.array([[-(2**15), 2**15 - 1]], np.int16),
        "INT32": np.array([[-(2**31), 2**31 - 1]], np.int32),
        "INT64": np.array([[-(2**63), 2**63 - 1]], np.int64),
        "FP16": np.array([[1.5, -2.25]], np.float16),
        "FP32": np.array([[1.5, -2.25]], np.float32),
        "FP64": np.array([[1.5, -2.25]], np.float64),
        "BYTES": np.array([[b"hello", b"\x00\xffbin"]], dtype=np.object_),
    }
    inputs = [_input(f"IN_{dt}", a, dt) for dt, a in arrays.items()]
    bf16 = httpclient.InferInput("IN_BF16", [1, 2], "BF16")
    bf16_bits = np.array([[0x3FC0, 0xC010]], np.uint16)  # 1.5, -2.25
    bf16._raw_data = bf16_bits.tobytes()
    bf16._parameters["binary_data_size"] = 4
    inputs.append(bf16)
    result = client.infer("dtypes", inputs)
    for dt, array in arrays.items():
        got = result.as_numpy(f"OUT_{dt}")
        assert got.dtype == array.dtype or dt == "BYTES", dt
        np.testing.assert_array_equal(got, array, err_msg=dt)
    raw = result._buffer  # BF16 has no numpy type: compare the bytes tritonclient received
    out = next(o for o in result.get_response()["outputs"] if o["name"] == "OUT_BF16")
    assert out["parameters"]["binary_data_size"] == 4
    assert bf16_bits.tobytes() in raw


def test_concurrent_requests_fill_one_batch(client: httpclient.InferenceServerClient) -> None:
    before = _batch_counts(client, "batch8")
    x = np.ones((1, 4), np.float32)
    pending = [client.async_infer("batch8", [_input("IN", x * i, "FP32")]) for i in range(8)]
    results = [p.get_result() for p in pending]
    for i, result in enumerate(results):
        np.testing.assert_array_equal(result.as_numpy("OUT"), x * i * 2)
    after = _batch_counts(client, "batch8")
    assert after.get(8, 0) - before.get(8, 0) == 1
    assert sum(after.values()) - sum(before.values()) == 1


def test_a_few_requests_wait_for_the_delay_then_run_together(
    client: httpclient.InferenceServerClient,
) -> None:
    before = _batch_counts(client, "batch8")
    x = np.ones((1, 4), np.float32)
    pending = [client.async_infer("batch8", [_input("IN", x, "FP32")]) for _ in range(3)]
    for p in pending:
        np.testing.assert_array_equal(p.get_result().as_numpy("OUT"), x * 2)
    after = _batch_counts(client, "batch8")
    assert after.get(3, 0) - before.get(3, 0) == 1
    assert sum(after.values()) - sum(before.values()) == 1


def _infer_from_threads(url: str, model: str, count: int, stagger_s: float) -> list[np.ndarray]:
    """`count` requests, one per thread on its own connection, released together by a barrier,
    thread i then `i * stagger_s` later: arrivals spread over many event-loop turns."""
    barrier = threading.Barrier(count)
    pacing = threading.Event()  # never set: wait(timeout) only shapes the arrivals

    def send(i: int) -> np.ndarray:
        with httpclient.InferenceServerClient(url) as own:
            x = np.full((1, 4), i, np.float32)
            barrier.wait()
            pacing.wait(stagger_s * i)
            return own.infer(model, [_input("IN", x, "FP32")]).as_numpy("OUT")

    with ThreadPoolExecutor(count) as pool:
        return list(pool.map(send, range(count)))


@pytest.mark.parametrize("stagger_s", [0.0, 0.01], ids=["together", "spread"])
def test_by_default_requests_wait_the_delay_out_as_in_triton(
    client: httpclient.InferenceServerClient, service: Service, stagger_s: float
) -> None:
    """No BATCH_DELAY parameter: Triton's wait. After a quiet spell (lone requests further
    apart than twice the 200 ms delay: what an adaptive delay would skip), eight clients send
    one request each, together or spread over 70 ms: one batch of eight."""
    quiet = threading.Event()  # never set: wait(timeout) makes the quiet spell
    x = np.ones((1, 4), np.float32)
    for _ in range(2):
        client.infer("burst8", [_input("IN", x, "FP32")])
        quiet.wait(0.45)
    before = _batch_counts(client, "burst8")
    outputs = _infer_from_threads(service.http_url, "burst8", 8, stagger_s)
    for i, out in enumerate(outputs):
        np.testing.assert_array_equal(out, np.full((1, 4), 2 * i, np.float32))
    after = _batch_counts(client, "burst8")
    ran = {size: n - before.get(size, 0) for size, n in after.items() if n != before.get(size, 0)}
    assert ran == {8: 1}


def test_requests_of_different_shapes_are_batched_by_shape(
    client: httpclient.InferenceServerClient,
) -> None:
    """Two lengths interleaved: two batches of 4 (the preferred size), one per length."""
    before = _batch_counts(client, "varlen")
    arrays = [np.arange(3 if i % 2 else 5, dtype=np.int32)[None, :] + i for i in range(8)]
    pending = [client.async_infer("varlen", [_input("IN", a, "INT32")]) for a in arrays]
    results = [p.get_result() for p in pending]
    for array, result in zip(arrays, results, strict=True):
        assert result.as_numpy("SUM")[0, 0] == array.sum()
    after = _batch_counts(client, "varlen")
    assert after.get(4, 0) - before.get(4, 0) == 2
    assert sum(after.values()) - sum(before.values()) == 2


def test_model_without_batching(client: httpclient.InferenceServerClient) -> None:
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    result = client.infer("nobatch", [_input("IN", x, "FP32")])
    np.testing.assert_array_equal(result.as_numpy("OUT"), x.T)
    assert client.get_model_metadata("nobatch")["inputs"][0]["shape"] == [2, 3]


def test_broken_model_is_reported_and_others_still_served(
    client: httpclient.InferenceServerClient,
) -> None:
    assert not client.is_model_ready("broken")
    index = {m["name"]: m for m in client.get_model_repository_index()}
    assert index["broken"]["state"] == "UNAVAILABLE"
    assert "preferred_batch_size" in index["broken"]["reason"]
    assert index["batch8"]["state"] == "READY"
    with pytest.raises(InferenceServerException) as err:
        client.infer("broken", [_input("IN", np.ones((1, 1), np.float32), "FP32")])
    assert "preferred_batch_size" in str(err.value)


@pytest.mark.parametrize(
    ("model", "inputs", "status", "message"),
    [
        ("nope", [("IN", np.ones((1, 4), np.float32), "FP32")], "404", "unknown model"),
        ("batch8", [("IN", np.ones((1, 5), np.float32), "FP32")], "400", "unexpected shape"),
        ("batch8", [("IN", np.ones((1, 4), np.int32), "INT32")], "400", "data-type"),
        (
            "batch8",
            [("IN", np.ones((9, 4), np.float32), "FP32")],
            "400",
            "inference request batch-size must be <= 8 for 'batch8'",
        ),
        ("batch8", [("WRONG", np.ones((1, 4), np.float32), "FP32")], "400", "'WRONG'"),
    ],
)
def test_bad_input_gets_400_naming_the_problem(
    client: httpclient.InferenceServerClient, model: str, inputs: list, status: str, message: str
) -> None:
    with pytest.raises(InferenceServerException) as err:
        client.infer(model, [_input(n, a, dt) for n, a, dt in inputs])
    assert err.value.status() == status
    assert message in err.value.message()


def test_malformed_json_body_is_400(service: Service) -> None:
    request = urllib.request.Request(
        f"http://{service.http_url}/v2/models/batch8/infer", data=b"{not json", method="POST"
    )
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request)
    assert err.value.code == 400
    # Triton's text; its 500 is not copied: a malformed body is the client's error
    assert b"failed to parse the request JSON buffer: " in err.value.read()


def test_statistics_and_metrics_cover_the_fleet(
    client: httpclient.InferenceServerClient, service: Service
) -> None:
    def successes() -> int:
        model = client.get_inference_statistics("batch8")["model_stats"][0]
        return int(model["inference_stats"]["success"]["count"])

    before = successes()
    client.infer("batch8", [_input("IN", np.ones((8, 4), np.float32), "FP32")])
    # the batch's statistics record may land just after its answer (on a cluster, on
    # another node than the reply stream)
    wait_until(lambda: successes() == before + 1, "the request's statistics")
    stats = client.get_inference_statistics("batch8")["model_stats"][0]
    for field in (
        "success",
        "fail",
        "queue",
        "compute_input",
        "compute_infer",
        "compute_output",
        "cache_hit",
        "cache_miss",
    ):
        assert set(stats["inference_stats"][field]) == {"count", "ns"}
    assert stats["inference_count"] >= 8
    text = urllib.request.urlopen(f"http://{service.metrics_url}/metrics").read().decode()
    success = next(
        line
        for line in text.splitlines()
        if line.startswith('nv_inference_request_success{model="batch8"')
    )
    assert float(success.split()[-1]) == stats["inference_stats"]["success"]["count"]
    for name in (
        "nv_inference_request_failure",
        "nv_inference_count",
        "nv_inference_exec_count",
        "nv_inference_pending_request_count",
        "nv_inference_request_duration_us",
        "nv_inference_queue_duration_us",
        "nv_inference_compute_infer_duration_us",
        "sluice_batch_size_bucket",
        "sluice_queue_duration_seconds_bucket",
        "sluice_request_duration_seconds_bucket",
        "sluice_stream_entries",
        "sluice_stream_pending_entries",
        "sluice_reclaimed_entries_total",
        "sluice_early_runs_total",
    ):
        assert name in text, name


def test_versions_are_served_side_by_side(client: httpclient.InferenceServerClient) -> None:
    assert client.get_model_metadata("versioned")["versions"] == ["1", "2"]
    x = np.array([[10]], np.int32)
    for version in ("1", "2"):
        result = client.infer("versioned", [_input("IN", x, "INT32")], model_version=version)
        assert result.as_numpy("OUT")[0, 0] == 10 + int(version)
        assert result.get_response()["model_version"] == version
    latest = client.infer("versioned", [_input("IN", x, "INT32")])
    assert latest.get_response()["model_version"] == "2"
    assert client.is_model_ready("versioned", "1")
    with pytest.raises(InferenceServerException) as err:
        client.infer("versioned", [_input("IN", x, "INT32")], model_version="3")
    assert err.value.status() == "404"  # Triton 2.51: an unknown version is an unknown model


def test_a_failing_request_does_not_poison_its_batch(
    client: httpclient.InferenceServerClient,
) -> None:
    before = _batch_counts(client, "picky")
    values = [1, 13, 2, 3]
    pending = [
        client.async_infer("picky", [_input("IN", np.array([[v]], np.int32), "INT32")])
        for v in values
    ]
    for value, request in zip(values, pending, strict=True):
        if value == 13:
            with pytest.raises(InferenceServerException) as err:
                request.get_result()
            assert err.value.status() == "500"
            assert "13 is unlucky" in err.value.message()
        else:
            assert request.get_result().as_numpy("OUT")[0, 0] == value * 10
    after = _batch_counts(client, "picky")
    assert after.get(4, 0) - before.get(4, 0) == 1  # they did meet in one batch
