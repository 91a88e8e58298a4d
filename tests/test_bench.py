"""`sluice bench`: window statistics, request encoding, response parsing, and a live run."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import numpy as np
import orjson
import pytest
from click.testing import CliRunner
from sluice.shared.datatypes import deserialize_bytes_elements

from sluice.bench.http import Connection, ProtocolError, encode_get, parse_head
from sluice.bench.loadgen import BenchError, BenchResult, LevelResult, bench, error_kind
from sluice.bench.payload import InputSpec, encode_infer, input_specs, make_array
from sluice.bench.report import batch_buckets, table, to_json, write_plot
from sluice.bench.server_stats import ServerTotals, model_totals, split
from sluice.bench.settings import BenchSettings, parse_levels, parse_url
from sluice.bench.stats import (
    Latency,
    Measurement,
    WindowSample,
    is_stable,
    measure,
    percentile,
    summarize,
    within,
)
from sluice.cli import main
from tests.conftest import Service

# ---------------------------------------------------------------- windows and stability


def test_percentile_is_nearest_rank() -> None:
    values = list(range(1, 101))
    assert [percentile(values, q) for q in (1, 50, 90, 95, 99, 100)] == [1, 50, 90, 95, 99, 100]
    assert percentile([7], 99) == 7
    assert percentile([10, 20, 30, 40], 50) == 20
    with pytest.raises(ValueError):
        percentile([], 50)


def test_summarize_reports_microseconds_and_ignores_order() -> None:
    lat = summarize([4000, 1000, 3000, 2000])
    assert lat == Latency(avg_us=2.5, p50_us=2.0, p90_us=4.0, p95_us=4.0, p99_us=4.0)
    assert summarize([]) is None


def _m(throughput: float, p95_us: float | None) -> Measurement:
    latency = Latency(1, 1, 1, p95_us, 1) if p95_us is not None else None
    return Measurement(1, 1.0, 1, 0, {}, throughput, latency, 0.0, None)


def test_within_percent_of_the_mean() -> None:
    assert within([90, 100, 110], 10)
    assert not within([80, 100, 120], 10)
    assert within([0, 0, 0], 5)
    assert not within([0, 0, 3], 5)


def test_stable_needs_three_agreeing_windows_on_throughput_and_p95() -> None:
    assert not is_stable([_m(100, 50), _m(100, 50)], 20)
    assert is_stable([_m(100, 50), _m(105, 52), _m(95, 48)], 20)
    assert not is_stable([_m(100, 50), _m(160, 50), _m(100, 50)], 20)
    assert not is_stable([_m(100, 50), _m(100, 90), _m(100, 50)], 20)
    # only the last three count
    assert is_stable([_m(10, 900), _m(100, 50), _m(100, 50), _m(100, 50)], 20)
    # windows without a successful request agree when none has one
    assert is_stable([_m(0, None)] * 3, 20)


def _totals(success: int, queue_ns: int, batches: dict[int, int]) -> ServerTotals:
    inferences = sum(b * n for b, n in batches.items())
    return ServerTotals(
        {"success": success, "queue": success, "compute_infer": success},
        {"success": success * 5000, "queue": queue_ns, "compute_infer": success * 2000},
        inferences,
        sum(batches.values()),
        batches,
    )


def test_measure_merges_windows() -> None:
    first = WindowSample(1.0, 0.1, [1000, 3000], {"HTTP 503: full": 1}, _totals(2, 2000, {2: 1}))
    second = WindowSample(
        2.0, 0.2, [2000, 4000, 5000, 6000], {"HTTP 503: full": 2}, _totals(4, 8000, {4: 1})
    )
    m = measure([first, second], batch_size=2)
    assert (m.windows, m.requests, m.errors) == (2, 6, 3)
    assert m.error_kinds == {"HTTP 503: full": 3}
    assert m.duration_s == 3.0
    assert m.throughput == 6 * 2 / 3.0
    assert m.client_cpu == pytest.approx(0.1)
    assert m.latency is not None and m.latency.p50_us == 3.0
    assert m.server is not None
    assert m.server.requests == 6
    assert m.server.queue_us == pytest.approx(10000 / 6 / 1e3)
    assert m.server.batch_sizes == {2: 1, 4: 1}
    assert m.server.avg_batch == 3.0


def test_measure_without_server_statistics() -> None:
    m = measure([WindowSample(1.0, 0.0, [], {}, None)], batch_size=1)
    assert m.server is None and m.latency is None and m.throughput == 0


# ---------------------------------------------------------------- server statistics


def _entry(name: str, version: str, success: int, batches: dict[int, int]) -> dict:
    phase = {"count": success, "ns": success * 1000}
    return {
        "name": name,
        "version": version,
        "inference_count": sum(b * n for b, n in batches.items()),
        "execution_count": sum(batches.values()),
        "inference_stats": {
            p: phase
            for p in ("success", "queue", "compute_input", "compute_infer", "compute_output")
        },
        "batch_stats": [
            {"batch_size": b, "compute_infer": {"count": n, "ns": 0}} for b, n in batches.items()
        ],
    }


def test_server_split_is_the_difference_of_two_statistics_bodies() -> None:
    before = {"model_stats": [_entry("m", "1", 10, {1: 4, 3: 2}), _entry("other", "1", 99, {})]}
    after = {
        "model_stats": [
            _entry("m", "1", 14, {1: 4, 3: 2, 4: 1}),
            _entry("m", "2", 6, {2: 3}),
            _entry("other", "1", 500, {8: 9}),
        ]
    }
    s = split(model_totals(after, "m") - model_totals(before, "m"))
    assert s.requests == 10
    assert s.queue_us == 1.0 and s.compute_infer_us == 1.0 and s.request_us == 1.0
    assert s.batch_sizes == {2: 3, 4: 1}
    assert (s.inferences, s.executions) == (10, 4)
    assert s.avg_batch == 2.5


def test_server_split_of_an_idle_window() -> None:
    s = split(ServerTotals() - ServerTotals())
    assert (s.requests, s.queue_us, s.avg_batch, s.batch_sizes) == (0, 0.0, 0.0, {})


# ---------------------------------------------------------------- request encoding


METADATA = {
    "name": "m",
    "inputs": [
        {"name": "x", "datatype": "FP32", "shape": [-1, 3, -1]},
        {"name": "s", "datatype": "BYTES", "shape": [-1, 2]},
    ],
}


def test_input_specs_from_metadata() -> None:
    specs = input_specs(METADATA, {"max_batch_size": 8}, 4)
    assert specs == [InputSpec("x", "FP32", (4, 3, 1)), InputSpec("s", "BYTES", (4, 2))]
    unbatched = input_specs(METADATA, {"max_batch_size": 0}, 1)
    assert unbatched[0].shape == (1, 3, 1)
    with pytest.raises(ValueError, match="max_batch_size"):
        input_specs(METADATA, {"max_batch_size": 0}, 2)
    with pytest.raises(ValueError, match="max_batch_size"):
        input_specs(METADATA, {"max_batch_size": 8}, 9)


def _split_request(raw: bytes) -> tuple[list[str], dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return lines, headers, body


def test_binary_request_frames_every_tensor() -> None:
    specs = input_specs(METADATA, {"max_batch_size": 8}, 2)
    rng = np.random.default_rng(1)
    arrays = [make_array(s, "random", rng) for s in specs]
    raw = encode_infer("h:1", "m", specs, arrays, binary=True, auth_token="tok")
    lines, headers, body = _split_request(raw)
    assert lines[0] == "POST /v2/models/m/infer HTTP/1.1"
    assert headers["Host"] == "h:1" and headers["Authorization"] == "Bearer tok"
    assert int(headers["Content-Length"]) == len(body)
    json_end = int(headers["Inference-Header-Content-Length"])
    header = orjson.loads(body[:json_end])
    assert header["parameters"] == {"binary_data_output": True}
    x_size = header["inputs"][0]["parameters"]["binary_data_size"]
    assert header["inputs"][0]["shape"] == [2, 3, 1]
    x = np.frombuffer(body[json_end : json_end + x_size], np.float32).reshape(2, 3, 1)
    np.testing.assert_array_equal(x, arrays[0])
    strings = deserialize_bytes_elements(body[json_end + x_size :])
    assert strings == arrays[1].reshape(-1).tolist()
    assert all(len(s) == 8 for s in strings)


def test_json_request_carries_data_inline() -> None:
    spec = InputSpec("h", "BF16", (1, 2))
    bits = np.array([[0x3F80, 0x4000]], np.uint16)  # 1.0, 2.0
    raw = encode_infer("h:1", "m", [spec], [bits], binary=False)
    _, headers, body = _split_request(raw)
    assert "Inference-Header-Content-Length" not in headers
    assert headers["Content-Type"] == "application/json"
    assert orjson.loads(body) == {
        "inputs": [{"name": "h", "shape": [1, 2], "datatype": "BF16", "data": [1.0, 2.0]}]
    }


@pytest.mark.parametrize("datatype", ["BOOL", "INT8", "UINT64", "FP16", "FP64", "BF16", "BYTES"])
def test_zeros_and_random_data_have_the_wire_layout(datatype: str) -> None:
    spec = InputSpec("t", datatype, (2, 3))
    for kind in ("zeros", "random"):
        array = make_array(spec, kind, np.random.default_rng(0))
        assert array.shape == (2, 3)
    assert make_array(InputSpec("t", "INT32", (4,)), "zeros", np.random.default_rng(0)).sum() == 0


def test_get_request_has_no_body() -> None:
    assert encode_get("h:1", "/v2/models/m") == b"GET /v2/models/m HTTP/1.1\r\nHost: h:1\r\n\r\n"


# ---------------------------------------------------------------- response parsing


def test_parse_head() -> None:
    head = parse_head(b"HTTP/1.1 200 OK\r\nContent-Type: x\r\nContent-Length: 12\r\n\r\n")
    assert (head.status, head.content_length, head.keep_alive) == (200, 12, True)
    closing = parse_head(
        b"HTTP/1.1 503 Service Unavailable\r\nconnection: close\r\ncontent-length: 0\r\n\r\n"
    )
    assert (closing.status, closing.content_length, closing.keep_alive) == (503, 0, False)
    assert not parse_head(b"HTTP/1.0 200 OK\r\nContent-Length: 1\r\n\r\n").keep_alive


@pytest.mark.parametrize(
    "head",
    [
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: many\r\n\r\n",
        b"SSH-2.0-OpenSSH\r\n\r\n",
    ],
)
def test_parse_head_rejects_what_it_does_not_speak(head: bytes) -> None:
    with pytest.raises(ProtocolError):
        parse_head(head)


def test_error_kind_uses_the_servers_message() -> None:
    assert error_kind(400, b'{"error": "unknown model"}') == "HTTP 400: unknown model"
    assert error_kind(502, b"<html>bad gateway") == "HTTP 502: <html>bad gateway"


async def test_connection_keeps_alive_and_follows_connection_close() -> None:
    """A canned server: two answers on one connection (the first split in odd pieces)."""
    requests: list[bytes] = []
    answers = [
        [b"HTTP/1.1 200 OK\r\nConte", b"nt-Length: 5\r\n\r\nhel", b"lo"],
        [b"HTTP/1.1 400 Bad Request\r\nConnection: close\r\nContent-Length: 2\r\n\r\n{}"],
    ]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for pieces in answers:
            requests.append(await reader.readuntil(b"\r\n\r\n"))
            for piece in pieces:
                writer.write(piece)
                await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    conn = await Connection("127.0.0.1", port).open()
    try:
        assert await conn.exchange(encode_get("a", "/one")) == (200, b"hello")
        assert not conn.closed
        assert await conn.exchange(encode_get("a", "/two")) == (400, b"{}")
        assert conn.closed
    finally:
        conn.close()
        server.close()
        await server.wait_closed()
    assert [r.split(b" ")[1] for r in requests] == [b"/one", b"/two"]


# ---------------------------------------------------------------- settings and report


def test_parse_url_and_levels() -> None:
    assert parse_url("127.0.0.1:8000") == ("127.0.0.1", 8000)
    assert parse_url("http://localhost:9/") == ("localhost", 9)
    assert parse_url("[::1]:8000") == ("::1", 8000)
    with pytest.raises(ValueError):
        parse_url("https://x:1")
    assert parse_levels("1, 8,32", integer=True) == (1, 8, 32)
    assert parse_levels("2.5", integer=False) == (2.5,)
    for bad in ("0", "x", ","):
        with pytest.raises(ValueError):
            parse_levels(bad, integer=True)


def _result() -> BenchResult:
    settings = BenchSettings(url="h:1", model="m", auth_token="secret", concurrency=(4,))
    sample = WindowSample(1.0, 0.05, [1000, 2000], {}, _totals(2, 10, {2: 1}))
    m = measure([sample], 1)
    return BenchResult(settings, [InputSpec("x", "FP32", (1, 3))], [LevelResult(4, True, [m], m)])


def test_report_table_and_json_without_the_token() -> None:
    result = _result()
    text = table(result)
    assert text.splitlines()[0].split()[:2] == ["concurrency", "infer/s"]
    assert text.splitlines()[1].split()[:2] == ["4", "2.0"]
    assert "concurrency 4: 2-3: 1 (100%)" in text
    doc = to_json(result)
    assert "secret" not in orjson.dumps(doc).decode()
    assert doc["levels"][0]["concurrency"] == 4
    assert doc["levels"][0]["result"]["server"]["batch_sizes"] == {"2": 1}
    assert doc["inputs"] == [{"name": "x", "datatype": "FP32", "shape": (1, 3)}]


def test_batch_buckets_are_power_of_two_ranges() -> None:
    assert batch_buckets({1: 5, 3: 2, 2: 1, 9: 4}) == {"1": 5, "2-3": 3, "4-7": 0, "8-15": 4}
    assert batch_buckets({}, up_to=4) == {"1": 0, "2-3": 0, "4-7": 0}
    assert batch_buckets({}) == {"1": 0}


def test_plot_is_skipped_without_matplotlib(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert not write_plot(_result(), tmp_path / "p.png")
    assert not (tmp_path / "p.png").exists()


def test_plot_is_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    assert write_plot(_result(), tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes().startswith(b"\x89PNG")


# ---------------------------------------------------------------- against a live sluice


def test_cli_sweeps_concurrency_against_sluice(service: Service, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    args = [
        "bench",
        "--url",
        service.http_url,
        "--model",
        "named_args",
        "--concurrency",
        "1,4",
        "--batch-size",
        "2",
        "--window-ms",
        "300",
        "--max-trials",
        "3",
        "--warmup-s",
        "0",
        "--json-out",
        str(out),
    ]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "executed batches by batch size" in result.output
    doc = orjson.loads(out.read_bytes())
    assert [level["concurrency"] for level in doc["levels"]] == [1, 4]
    for level in doc["levels"]:
        assert len(level["windows"]) == 3  # stability needs 3 windows; max-trials is 3
        m = level["result"]
        assert m["errors"] == 0 and m["requests"] > 0
        assert m["throughput"] == pytest.approx(m["requests"] * 2 / m["duration_s"])
        assert m["requests"] == sum(w["requests"] for w in level["windows"])
        server = m["server"]
        assert server["requests"] > 0 and server["executions"] > 0
        # every request carries 2 rows, so every executed batch is even and at most 8
        assert all(int(b) % 2 == 0 and int(b) <= 8 for b in server["batch_sizes"])
        assert server["avg_batch"] >= 2


async def test_open_loop_json_tensors_against_sluice(service: Service) -> None:
    settings = BenchSettings(
        url=service.http_url,
        model="nobatch",
        request_rate=(40.0,),
        distribution="poisson",
        binary=False,
        window_ms=250,
        max_trials=3,
        warmup_s=0,
    )
    windows: list[int] = []
    result = await bench(settings, lambda level, trial, m: windows.append(trial))
    assert windows == [1, 2, 3]
    assert result.inputs == [InputSpec("IN", "FP32", (2, 3))]
    (level,) = result.levels
    assert level.level == 40.0 and level.result.errors == 0 and level.result.requests > 0
    assert level.result.server is not None and level.result.server.requests > 0


async def test_unknown_model_is_a_clear_error(service: Service) -> None:
    settings = BenchSettings(url=service.http_url, model="no_such_model", concurrency=(1,))
    with pytest.raises(BenchError, match="HTTP 404: Request for unknown model"):
        await bench(settings, lambda *_: None)
