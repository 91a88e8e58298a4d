"""Bulk jobs: files in and out, over HTTP and the CLI, and resuming after an rq worker dies."""

from __future__ import annotations

import http.client
import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import orjson
import pytest
import redis
from sluice.shared import keys
from sluice.shared.bulk import bulk_queue, bulk_status, cancel_bulk, submit_bulk
from sluice.shared.bulk_files import (
    ERROR_ARRAY,
    STATUS_ARRAY,
    check_output_shapes,
    format_of,
    read_items,
    write_output,
)
from sluice.shared.errors import Conflict, InvalidInput, Unavailable
from sluice.shared.protocol import Result, Tensor
from sluice.shared.redis_client import sync_client
from sluice.shared.registry import encode_model_record
from sluice.shared.signature import Signature
from sluice.shared.stats import read_stats_command, stats_hash

from tests.conftest import (
    Service,
    needs_single_redis,
    start_sluice,
    stop_service,
    wait_until,
)

pytestmark = needs_single_redis  # rq, which bulk jobs run on, does not work on a cluster

AFFINE = {
    "name": "affine",
    "max_batch_size": 64,
    "input": [{"name": "X", "data_type": "TYPE_FP32", "dims": [4]}],
    "output": [{"name": "Y", "data_type": "TYPE_FP32", "dims": [4]}],
}
SIG = Signature.from_config(AFFINE)
WAIT_S = 120


def _npz(**arrays: np.ndarray) -> bytes:
    out = io.BytesIO()
    np.savez(out, **arrays)
    return out.getvalue()


def _npy(array: np.ndarray) -> bytes:
    out = io.BytesIO()
    np.save(out, array)
    return out.getvalue()


def _inference_count(client: redis.Redis, model: str) -> int:
    stats = stats_hash(client.execute_command(*read_stats_command(model)))
    return int(stats.get(b"1:inference_count", 0))


# --- files --------------------------------------------------------------------------------


def test_an_npz_file_gives_one_item_per_row_with_a_batch_dim() -> None:
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    items = read_items(_npz(X=x), "npz", SIG)
    assert len(items) == 3
    (tensor,) = items[2].inputs
    assert (tensor.name, tensor.datatype, tensor.shape) == ("X", "FP32", (1, 4))
    np.testing.assert_array_equal(np.frombuffer(tensor.data, np.float32), x[2])


def test_an_npy_file_feeds_the_only_input() -> None:
    items = read_items(_npy(np.zeros((5, 4), np.float32)), "npy", SIG)
    assert [i.inputs[0].name for i in items] == ["X"] * 5


@pytest.mark.parametrize(
    ("data", "fmt", "message"),
    [
        (_npz(Z=np.zeros((2, 4), np.float32)), "npz", "unexpected inference input 'Z'"),
        (_npz(X=np.zeros((2, 5), np.float32)), "npz", "Expected [-1,4], got [1,5]"),
        (_npz(X=np.zeros((2, 4), np.int64)), "npz", "input 'X' data-type is 'INT64'"),
        (_npz(X=np.zeros((0, 4), np.float32)), "npz", "no items"),
        (b"not a numpy file", "npy", "not a valid .npy file"),
        (_npz(X=np.zeros((2, 4), np.float32)), "npy", "an .npz archive, not an .npy"),
        (b'{"inputs": []}\n', "jsonl", "line 1: 'inputs' must be a non-empty list"),
    ],
)
def test_a_bad_file_is_refused_naming_the_field_or_line(
    data: bytes, fmt: str, message: str
) -> None:
    with pytest.raises(InvalidInput, match=message.replace("[", r"\[").replace("]", r"\]")):
        read_items(data, fmt, SIG)


def test_json_lines_keep_each_line_s_id_and_count_lines_from_one() -> None:
    good = {
        "id": "a",
        "inputs": [{"name": "X", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}],
    }
    bad = {"inputs": [{"name": "X", "shape": [1, 3], "datatype": "FP32", "data": [1, 2, 3]}]}
    data = (json.dumps(good) + "\n\n" + json.dumps(good) + "\n").encode()
    assert [i.client_id for i in read_items(data, "jsonl", SIG)] == ["a", "a"]
    with pytest.raises(InvalidInput, match=r"line 2: .*unexpected shape for input 'X'"):
        read_items((json.dumps(good) + "\n" + json.dumps(bad)).encode(), "jsonl", SIG)


def test_formats_come_from_file_names_and_arrays_need_fixed_output_dims() -> None:
    assert [format_of(n) for n in ("a.NPZ", "b.npy", "c.jsonl", "d.ndjson")] == [
        "npz",
        "npy",
        "jsonl",
        "jsonl",
    ]
    with pytest.raises(InvalidInput, match=r"'x\.csv'"):
        format_of("x.csv")
    varlen = Signature.from_config(
        {**AFFINE, "output": [{"name": "Y", "data_type": "TYPE_FP32", "dims": [-1]}]}
    )
    with pytest.raises(InvalidInput, match=r"output 'Y' .* use a \.jsonl input"):
        check_output_shapes(varlen, "npz")
    check_output_shapes(varlen, "jsonl")


def test_results_keep_input_order_and_failed_items_are_marked() -> None:
    items = read_items(_npz(X=np.zeros((3, 4), np.float32)), "npz", SIG)
    ok = [
        Result(str(i), [Tensor("Y", "FP32", (1, 4), np.full(4, i, np.float32).tobytes())])
        for i in (0, 2)
    ]
    failed = Result("1", error=("INVALID_ARG", "input 'X' is odd"))
    out = np.load(io.BytesIO(write_output("npz", SIG, 1, items, [ok[0], failed, ok[1]])))
    np.testing.assert_array_equal(out["Y"][:, 0], [0, 0, 2])
    assert out[STATUS_ARRAY].tolist() == [200, 400, 200]
    assert out[ERROR_ARRAY].tolist() == ["", "input 'X' is odd", ""]
    lines = write_output("jsonl", SIG, 1, items, [ok[0], failed, ok[1]]).splitlines()
    assert orjson.loads(lines[1]) == {"error": "input 'X' is odd", "status": 400}
    assert orjson.loads(lines[2])["outputs"][0]["data"] == [2.0] * 4


# --- over HTTP and the CLI, against `sluice serve` (one bulk rq worker) ----------------------


def _http(
    service: Service, method: str, path: str, body: bytes | None = None, ctype: str = ""
) -> tuple[int, bytes, dict[str, str]]:
    host, port = service.http_url.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request(method, path, body=body, headers={"Content-Type": ctype} if ctype else {})
    response = conn.getresponse()
    data = response.read()
    headers = {k.lower(): v for k, v in response.getheaders()}
    conn.close()
    return response.status, data, headers


def _finished(service: Service, bulk_id: str) -> dict:
    def done() -> bool:
        _, body, _ = _http(service, "GET", f"/v2/bulk/{bulk_id}")
        return json.loads(body)["status"] in ("done", "failed", "cancelled")

    wait_until(done, f"bulk job {bulk_id}", WAIT_S)
    return json.loads(_http(service, "GET", f"/v2/bulk/{bulk_id}")[1])


def test_bulk_over_http_upload_then_download_in_input_order(service: Service) -> None:
    client = sync_client(service.redis_url)
    x = np.random.default_rng(3).standard_normal((300, 4)).astype(np.float32)
    x[123] = 13  # this item fails; its neighbours in the same batch do not
    before = _inference_count(client, "affine")
    status, body, headers = _http(
        service, "POST", "/v2/models/affine/bulk?id=http-npz", _npz(X=x), "application/x-npz"
    )
    assert status == 202, body
    assert headers["location"] == "/v2/bulk/http-npz"
    assert json.loads(body)["total"] == 300
    final = _finished(service, "http-npz")
    assert (final["status"], final["done"], final["failed"]) == ("done", 300, 1)
    status, data, headers = _http(service, "GET", "/v2/bulk/http-npz/output")
    assert status == 200 and headers["content-type"] == "application/x-npz"
    out = np.load(io.BytesIO(data))
    ok = np.arange(300) != 123
    np.testing.assert_allclose(out["Y"][ok], x[ok] * 2 + 1)
    assert out[STATUS_ARRAY][123] == 500 and "13 is unlucky" in out[ERROR_ARRAY][123]
    # the same id again is the same job: nothing runs twice
    status, body, _ = _http(
        service, "POST", "/v2/models/affine/bulk?id=http-npz&format=npz", _npz(X=x)
    )
    assert status == 202 and json.loads(body)["status"] == "done"
    # ... and another file under it is refused, naming the id
    status, body, _ = _http(
        service, "POST", "/v2/models/affine/bulk?id=http-npz&format=npz", _npz(X=x + 1)
    )
    assert status == 409 and "bulk job 'http-npz' already exists" in json.loads(body)["error"]
    assert _inference_count(client, "affine") - before == 300


def test_bulk_json_lines_over_http_echo_each_line_s_id(service: Service) -> None:
    lines = [
        {
            "id": f"line-{i}",
            "inputs": [{"name": "X", "shape": [1, 4], "datatype": "FP32", "data": [i + 0.5] * 4}],
        }
        for i in range(20)
    ]
    upload = "\n".join(json.dumps(line) for line in lines).encode()
    status, body, _ = _http(
        service, "POST", "/v2/models/affine/bulk", upload, "application/x-ndjson"
    )
    assert status == 202, body
    bulk_id = json.loads(body)["id"]
    assert _finished(service, bulk_id)["done"] == 20
    status, data, headers = _http(service, "GET", f"/v2/bulk/{bulk_id}/output")
    assert status == 200 and headers["content-type"] == "application/x-ndjson"
    answers = [orjson.loads(line) for line in data.splitlines()]
    assert [a["id"] for a in answers] == [f"line-{i}" for i in range(20)]
    assert [a["outputs"][0]["data"][0] for a in answers] == [2 * i + 2.0 for i in range(20)]


@pytest.mark.parametrize(
    ("path", "body", "status", "message"),
    [
        ("/v2/models/affine/bulk", b"x", 400, "?format=npz|npy|jsonl"),
        ("/v2/models/affine/bulk?format=jsonl", b'{"inputs": 3}', 400, "line 1: 'inputs'"),
        ("/v2/models/affine/bulk?format=npz&window=0", _npz(X=np.zeros((1, 4))), 400, "'window'"),
        ("/v2/models/nope/bulk?format=npz", b"", 404, "unknown model: 'nope'"),
    ],
)
def test_bad_bulk_uploads_get_clear_errors(
    service: Service, path: str, body: bytes, status: int, message: str
) -> None:
    got, data, _ = _http(service, "POST", path, body)
    assert got == status, data
    assert message in json.loads(data)["error"]


def test_variable_input_dims_are_accepted_when_the_outputs_are_fixed(service: Service) -> None:
    upload = _npz(IN=np.zeros((2, 3), np.int32))
    got, data, _ = _http(service, "POST", "/v2/models/varlen/bulk?format=npz", upload)
    assert got == 202, data


def test_unknown_bulk_jobs_are_404(service: Service) -> None:
    for method, path in (
        ("GET", "/v2/bulk/nope"),
        ("GET", "/v2/bulk/nope/output"),
        ("DELETE", "/v2/bulk/nope"),
    ):
        status, data, _ = _http(service, method, path)
        assert status == 404 and "'nope'" in json.loads(data)["error"]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sluice", "jobs", *args],
        capture_output=True,
        text=True,
        timeout=WAIT_S,
        check=False,
    )


def test_the_jobs_cli_submits_waits_and_writes_the_results(
    service: Service, tmp_path: Path
) -> None:
    x = np.arange(100, 500, dtype=np.float32).reshape(100, 4)  # no 13: affine fails on it
    source, target = tmp_path / "in.npy", tmp_path / "out.npz"
    np.save(source, x)
    url = ["--redis-url", service.redis_url]
    run = _cli(
        "submit",
        *url,
        "--model",
        "affine",
        "--input",
        str(source),
        "--output",
        str(target),
        "--id",
        "cli-1",
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "cli-1"
    assert "100/100  100%  done" in run.stderr  # the progress bar's last line
    np.testing.assert_allclose(np.load(target)["Y"], x * 2 + 1)
    status = _cli("status", *url, "cli-1")
    assert "[##############################]  100/100" in status.stdout
    assert "cli-1" in _cli("list", *url).stdout
    again = tmp_path / "again.npz"
    assert _cli("result", *url, "cli-1", "--output", str(again)).returncode == 0
    assert again.read_bytes() == target.read_bytes()
    missing = _cli("status", *url, "nope")
    assert missing.returncode == 1 and "bulk job 'nope' is unknown" in missing.stderr


# --- rq side: cancelling, and an rq worker killed halfway ---------------------------------


def _announce_affine(client: redis.Redis) -> None:
    """What a worker serving `affine` publishes, for tests that run no model worker."""
    client.hset(keys.MODELS, "affine", encode_model_record(AFFINE, [1], None))


def test_a_queued_bulk_job_can_be_cancelled(redis_url: str) -> None:
    client = sync_client(redis_url)
    _announce_affine(client)
    status = submit_bulk(
        client, "affine", _npz(X=np.zeros((5, 4), np.float32)), "npz", bulk_id="to-cancel"
    )
    assert status.status == "queued" and status.total == 5
    assert cancel_bulk(client, "to-cancel").status == "cancelled"
    assert bulk_status(client, "to-cancel").status == "cancelled"


def test_a_bulk_id_is_its_upload_s_and_refused_for_another(redis_url: str) -> None:
    client = sync_client(redis_url)
    _announce_affine(client)
    x = np.zeros((5, 4), np.float32)
    first = submit_bulk(client, "affine", _npz(X=x), "npz", bulk_id="same")
    assert submit_bulk(client, "affine", _npz(X=x), "npz", bulk_id="same") == first
    message = (
        "bulk job 'same' already exists for another upload (model, version, file, format or "
        "window differ): give each upload its own id"
    )
    for upload, kwargs in (
        (_npz(X=x + 1), {}),
        (_npz(X=x), {"window": 7}),
        (_npz(X=x), {"version": 1}),
        (_npy(x), {"fmt": "npy"}),
    ):
        with pytest.raises(Conflict) as refused:
            submit_bulk(
                client, "affine", upload, kwargs.pop("fmt", "npz"), bulk_id="same", **kwargs
            )
        assert refused.value.message == message
    assert len(bulk_queue(client)) == 1


def test_bulk_jobs_kept_are_bounded(redis_url: str) -> None:
    client = sync_client(redis_url)
    _announce_affine(client)
    upload = _npz(X=np.zeros((2, 4), np.float32))
    for bulk_id in ("kept-1", "kept-2"):
        submit_bulk(client, "affine", upload, "npz", bulk_id=bulk_id, max_jobs=2)
    with pytest.raises(Unavailable, match=r"too many bulk jobs: 2 are kept already"):
        submit_bulk(client, "affine", upload, "npz", bulk_id="kept-3", max_jobs=2)
    assert not client.exists(keys.bulk_key("kept-3", "spec"), keys.bulk_key("kept-3", "input"))
    # the same upload again is the job there, not one more
    assert submit_bulk(client, "affine", upload, "npz", bulk_id="kept-1", max_jobs=2).id == "kept-1"
    client.zadd(keys.BULK_KEPT, {"kept-2": 1})  # as if its TTL had ended long ago
    assert submit_bulk(client, "affine", upload, "npz", bulk_id="kept-3", max_jobs=2).total == 2


def test_a_bulk_job_resumes_after_its_rq_worker_is_killed(redis_url: str, model_repo: Path) -> None:
    """10k items; the rq worker dies halfway; another takes over; each item ran exactly once."""
    client = sync_client(redis_url)
    model_worker = start_sluice(
        "worker",
        ["--model-repository", str(model_repo), "--redis-url", redis_url, "--models", "affine"],
        ready="'affine' versions",
    )
    first = start_sluice("jobs", ["worker", "--redis-url", redis_url], ready="Listening on")
    second = None
    try:
        x = np.random.default_rng(7).standard_normal((10_000, 4)).astype(np.float32)
        submit_bulk(client, "affine", _npz(X=x), "npz", bulk_id="big", window=256)
        # the model's own count is live (progress lags by up to PROGRESS_S); pausing the model
        # worker before the kill keeps the job from finishing first
        wait_until(
            lambda: _inference_count(client, "affine") >= 3_000, "a third of the items", WAIT_S
        )
        os.kill(model_worker.process.pid, signal.SIGSTOP)
        os.kill(first.process.pid, signal.SIGKILL)
        first.process.wait(10)
        os.kill(model_worker.process.pid, signal.SIGCONT)
        halfway = bulk_status(client, "big")
        assert halfway.status == "running" and halfway.done < 10_000
        second = start_sluice("jobs", ["worker", "--redis-url", redis_url], ready="Listening on")
        wait_until(lambda: bulk_status(client, "big").status == "done", "the resumed job", WAIT_S)
        out = np.load(io.BytesIO(client.get(keys.bulk_key("big", "output"))))
        np.testing.assert_allclose(out["Y"], x * 2 + 1)
        assert (out[STATUS_ARRAY] == 200).all()
        assert _inference_count(client, "affine") == 10_000  # nothing computed twice
        log = "".join(second.log)
        assert "running it again" in log and "bulk big: resuming" in log
    finally:
        for svc in (second, first, model_worker):
            if svc is not None:
                stop_service(svc)


def test_a_bulk_lease_has_one_holder_at_a_time(redis_url: str) -> None:
    from sluice.workers.bulk import HOLD_LEASE, LEASE_MS, RELEASE_LEASE

    client = sync_client(redis_url)
    lease = keys.bulk_key("leased", "lease")
    assert HOLD_LEASE.run(client, [lease], ["a", LEASE_MS]) == 1
    assert HOLD_LEASE.run(client, [lease], ["b", LEASE_MS]) == 0  # a holds it
    assert HOLD_LEASE.run(client, [lease], ["a", LEASE_MS]) == 1  # a renews
    client.set(lease, "requeued")  # an rq worker found a's feeder dead
    assert HOLD_LEASE.run(client, [lease], ["b", LEASE_MS]) == 1
    # a, back from a stall, cannot free b's lease
    assert RELEASE_LEASE.run(client, [lease], ["a"]) == 0
    assert client.get(lease) == b"b"


def test_a_running_bulk_job_stops_feeding_when_cancelled(service: Service) -> None:
    """batch8 waits 1 s for company, so with a window of 1 the job feeds an item a second."""
    client = sync_client(service.redis_url)
    x = np.full((20, 4), 2.0, np.float32)
    submit_bulk(client, "batch8", _npz(IN=x), "npz", bulk_id="cancel-running", window=1)
    wait_until(lambda: bulk_status(client, "cancel-running").done >= 1, "the first item", WAIT_S)
    assert cancel_bulk(client, "cancel-running").status == "cancelled"
    wait_until(
        lambda: client.get(keys.bulk_key("cancel-running", "lease")) is None, "the feeder", WAIT_S
    )
    fed = int(client.get(keys.bulk_fed("batch8", "cancel-running")) or 0)
    assert fed < 20
    assert bulk_status(client, "cancel-running").status == "cancelled"
