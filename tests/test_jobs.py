"""Asynchronous jobs over HTTP: submit, fetch later (or long-poll), idempotency, cancel."""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import tritonclient.http as httpclient
from sluice.shared import keys
from sluice.shared.redis_client import sync_client

from sluice.client import Client, Job
from tests.conftest import Service


def _call(service: Service, method: str, path: str, body: Any = None) -> tuple[int, dict, dict]:
    host, port = service.http_url.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    payload = json.dumps(body).encode() if body is not None else None
    conn.request(method, path, body=payload)
    response = conn.getresponse()
    data = response.read()
    headers = {k.lower(): v for k, v in response.getheaders()}
    conn.close()
    return response.status, json.loads(data) if data else {}, headers


def _body(value: float, job_id: str | None = None) -> dict:
    body: dict = {
        "inputs": [{"name": "IN", "datatype": "FP32", "shape": [2, 3], "data": [value] * 6}]
    }
    if job_id is not None:
        body["id"] = job_id
    return body


def _exec_count(service: Service, model: str) -> int:
    client = httpclient.InferenceServerClient(service.http_url)
    stats = client.get_inference_statistics(model)["model_stats"][0]
    client.close()
    return int(stats["execution_count"])


def test_submit_then_collect_with_a_long_poll(service: Service) -> None:
    status, body, headers = _call(service, "POST", "/v2/models/nobatch/jobs", _body(2.0))
    assert status == 202
    job_id = body["id"]
    assert headers["location"] == f"/v2/jobs/{job_id}"
    status, result, _ = _call(service, "GET", f"/v2/jobs/{job_id}?wait=30")
    assert status == 200
    assert result["model_name"] == "nobatch"
    assert result["outputs"][0]["shape"] == [3, 2]
    assert result["outputs"][0]["data"] == [2.0] * 6
    # the result stays for every later reader
    assert _call(service, "GET", f"/v2/jobs/{job_id}")[1] == result


def test_resubmitting_an_id_returns_the_same_job_and_runs_once(service: Service) -> None:
    before = _exec_count(service, "nobatch")
    first = _call(service, "POST", "/v2/models/nobatch/jobs", _body(1.0, "job-idem-1"))
    status, result, _ = _call(service, "GET", "/v2/jobs/job-idem-1?wait=30")
    assert (first[0], first[1]["id"], status) == (202, "job-idem-1", 200)
    again = _call(service, "POST", "/v2/models/nobatch/jobs", _body(1.0, "job-idem-1"))
    assert again[:2] == (
        202,
        {"id": "job-idem-1", "status": "done", "model_name": "nobatch", "model_version": "1"},
    )
    assert _call(service, "GET", "/v2/jobs/job-idem-1")[1] == result
    assert _exec_count(service, "nobatch") - before == 1


def test_an_id_reused_for_another_request_is_a_409_naming_it(service: Service) -> None:
    assert _call(service, "POST", "/v2/models/nobatch/jobs", _body(1.0, "job-idem-2"))[0] == 202
    other_inputs = _body(5.0, "job-idem-2")
    other_outputs = _body(1.0, "job-idem-2") | {"outputs": [{"name": "OUT"}]}
    other_parameters = _body(1.0, "job-idem-2") | {"parameters": {"tag": "b"}}
    other_model = {
        "id": "job-idem-2",
        "inputs": [{"name": "IN", "datatype": "FP32", "shape": [1, 4], "data": [1.0] * 4}],
    }
    for path, body in (
        ("/v2/models/nobatch/jobs", other_inputs),
        ("/v2/models/nobatch/jobs", other_outputs),
        ("/v2/models/nobatch/jobs", other_parameters),
        ("/v2/models/nobatch/versions/1/jobs", _body(1.0, "job-idem-2")),
        ("/v2/models/batch8/jobs", other_model),
    ):
        status, answer, _ = _call(service, "POST", path, body)
        assert (status, answer) == (
            409,
            {
                "error": "job 'job-idem-2' already exists for another request (model, version, "
                "inputs, parameters or outputs differ): give each request its own id"
            },
        ), path
    status, result, _ = _call(service, "GET", "/v2/jobs/job-idem-2?wait=30")
    assert status == 200 and result["outputs"][0]["data"] == [1.0] * 6


def test_unknown_job_is_404_and_bad_input_is_400(service: Service) -> None:
    status, body, _ = _call(service, "GET", "/v2/jobs/never-submitted")
    assert status == 404 and "unknown" in body["error"]
    status, body, _ = _call(
        service,
        "POST",
        "/v2/models/nobatch/jobs",
        {"inputs": [{"name": "IN", "datatype": "FP32", "shape": [9], "data": [1.0] * 9}]},
    )
    assert status == 400 and "'IN'" in body["error"]


def test_cancel_before_it_runs_and_not_after(service: Service) -> None:
    # batch8 waits up to a second to fill a batch: the job is still queued when cancelled
    x = {
        "inputs": [
            {"name": "IN", "datatype": "FP32", "shape": [1, 4], "data": np.ones(4).tolist()}
        ],
        "id": "job-cancel-1",
    }
    assert _call(service, "POST", "/v2/models/batch8/jobs", x)[0] == 202
    status, body, _ = _call(service, "DELETE", "/v2/jobs/job-cancel-1")
    assert (status, body["status"]) == (200, "cancelled")
    status, body, _ = _call(service, "GET", "/v2/jobs/job-cancel-1")
    assert status == 400 and "cancelled" in body["error"]
    done = _call(service, "POST", "/v2/models/nobatch/jobs", _body(1.0, "job-cancel-2"))[1]
    _call(service, "GET", f"/v2/jobs/{done['id']}?wait=30")
    assert _call(service, "DELETE", "/v2/jobs/job-cancel-2")[0] == 409
    assert _call(service, "DELETE", "/v2/jobs/nope")[0] == 404


def _events(service: Service, job_id: str) -> list[tuple[str, dict]]:
    host, port = service.http_url.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("GET", f"/v2/jobs/{job_id}/events")
    response = conn.getresponse()
    assert response.getheader("content-type") == "text/event-stream"
    text = response.read().decode()  # the server closes the stream after the result
    conn.close()
    events = []
    for block in text.split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines() if not line.startswith(":"))
        if lines:
            events.append((lines["event"], json.loads(lines["data"])))
    return events


def test_events_reach_every_listener_and_the_pubsub_channel(service: Service) -> None:
    channel = sync_client(service.redis_url).pubsub()
    channel.subscribe(keys.job_channel("job-sse-1"))
    channel.get_message(timeout=5)  # subscription confirmed
    body = {
        "id": "job-sse-1",
        "inputs": [
            {"name": "IN", "datatype": "FP32", "shape": [1, 4], "data": [1.0, 2.0, 3.0, 4.0]}
        ],
    }
    assert _call(service, "POST", "/v2/models/batch8/jobs", body)[0] == 202
    with ThreadPoolExecutor(3) as pool:
        streams = list(pool.map(lambda _: _events(service, "job-sse-1"), range(3)))
    for events in streams:
        assert events[0][0] == "status"
        assert events[-2] == ("status", {"id": "job-sse-1", "status": "done"})
        kind, result = events[-1]
        assert kind == "result" and result["outputs"][0]["data"] == [2.0, 4.0, 6.0, 8.0]
    statuses = []
    while len(statuses) < 2:
        message = channel.get_message(ignore_subscribe_messages=True, timeout=10)
        assert message is not None, statuses
        statuses.append(json.loads(message["data"])["status"])
    assert statuses == ["queued", "done"]
    channel.close()


def test_a_job_outlives_the_client_that_submitted_it(service: Service) -> None:
    """The submitting process is SIGKILLed right after the 202; anyone fetches the result later."""
    script = (
        "import sys, time, numpy as np\n"
        "from sluice.client import Client\n"
        f"job = Client('http://{service.http_url}').submit('batch8', "
        "{'IN': np.full((1, 4), 3, np.float32)})\n"
        "print(job.id, flush=True)\n"
        "time.sleep(600)\n"
    )
    client = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert client.stdout is not None
    job_id = client.stdout.readline().strip()
    client.kill()
    client.wait(10)
    client.stdout.close()
    with Client(f"http://{service.http_url}") as later:
        outputs = Job(later, job_id).result(timeout_s=30)
    np.testing.assert_array_equal(outputs["OUT"], np.full((1, 4), 6, np.float32))
