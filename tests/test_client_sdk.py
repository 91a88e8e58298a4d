"""The Python SDK against a live `sluice serve`: infer, jobs, as_completed, asyncio, errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sluice.client import AsyncClient, Client, Job, RedisClient, as_completed, errors
from tests.conftest import Service


def test_infer_with_numpy_and_torch(service: Service) -> None:
    with Client(service.http_url) as client:
        x = np.arange(6, dtype=np.float32).reshape(2, 3)
        np.testing.assert_array_equal(client.infer("nobatch", {"IN": x})["OUT"], x.T)
        outputs = client.infer(
            "named_args", {"x": torch.ones(2, 3), "scale": torch.tensor([[2.0], [3.0]])}
        )
        np.testing.assert_array_equal(outputs["OUTPUT__0"], [[2, 2, 2], [3, 3, 3]])


def test_errors_are_typed_and_carry_the_message(service: Service) -> None:
    with Client(service.http_url) as client:
        with pytest.raises(errors.InvalidRequest) as err:
            client.infer("nobatch", {"IN": np.ones((5,), np.float32)})
        assert err.value.status == 400 and "'IN'" in err.value.message
        with pytest.raises(errors.ModelNotFound, match="404: Request for unknown model"):
            client.infer("nope", {"IN": np.ones((2, 3), np.float32)})
        with pytest.raises(errors.InvalidRequest):  # as before the 404
            client.infer("nope", {"IN": np.ones((2, 3), np.float32)})


def test_jobs_submit_result_status_cancel_and_as_completed(service: Service) -> None:
    with Client(service.http_url) as client:
        jobs = [client.submit("nobatch", {"IN": np.full((2, 3), v, np.float32)}) for v in range(4)]
        finished = list(as_completed(jobs, timeout_s=60))
        assert sorted(j.id for j in finished) == sorted(j.id for j in jobs)
        for value, job in enumerate(jobs):
            assert job.status() == "done"
            np.testing.assert_array_equal(job.result(timeout_s=30)["OUT"], np.full((3, 2), value))
        again = {"IN": np.full((2, 3), 0, np.float32)}  # jobs[0]'s request: its job
        assert client.submit("nobatch", again, job_id=jobs[0].id).id == jobs[0].id
        with pytest.raises(errors.Conflict, match=f"409: job '{jobs[0].id}' already exists"):
            client.submit("nobatch", {"IN": np.ones((2, 3), np.float32)}, job_id=jobs[0].id)
        assert jobs[0].cancel() is False
        slow = client.submit("batch8", {"IN": np.ones((1, 4), np.float32)})
        assert slow.cancel() is True
        with pytest.raises(errors.InvalidRequest, match="cancelled"):
            slow.result(timeout_s=30)


async def test_async_client(service: Service) -> None:
    async with AsyncClient(service.http_url) as client:
        x = np.arange(6, dtype=np.float32).reshape(2, 3)
        outputs = await client.infer("nobatch", {"IN": x})
        np.testing.assert_array_equal(outputs["OUT"], x.T)
        job = await client.submit("nobatch", {"IN": x})
        np.testing.assert_array_equal((await job.result(timeout_s=30))["OUT"], x.T)
        assert await job.status() == "done"
        with pytest.raises(errors.InvalidRequest, match="job 'id'"):
            await client.submit("nobatch", {"IN": x}, job_id="bad id with spaces")


def test_jobs_straight_to_redis_are_the_gateways_jobs(service: Service) -> None:
    direct = RedisClient(service.redis_url)
    x = np.full((2, 3), 7.0, np.float32)
    job = direct.submit("nobatch", {"IN": x}, job_id="direct-1")
    np.testing.assert_array_equal(job.result(timeout_s=30)["OUT"], x.T)
    assert job.status() == "done"
    with Client(service.http_url) as client:  # the same job, read through a gateway
        np.testing.assert_array_equal(Job(client, "direct-1").result(timeout_s=30)["OUT"], x.T)
    bad = direct.submit("nobatch", {"IN": np.ones((9,), np.float32)})
    with pytest.raises(errors.InvalidRequest, match="'IN'"):
        bad.result(timeout_s=30)
    with pytest.raises(errors.InvalidRequest, match="unknown model"):
        direct.submit("nope", {"IN": x})
    direct.close()


def test_outputs_come_back_as_torch_tensors_when_asked(service: Service) -> None:
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    with Client(service.http_url, tensors="torch") as client:
        out = client.infer("nobatch", {"IN": x})["OUT"]
        assert isinstance(out, torch.Tensor) and torch.equal(out, x.T)
        job = client.submit("nobatch", {"IN": x})
        assert torch.equal(job.result(timeout_s=30)["OUT"], x.T)
    direct = RedisClient(service.redis_url, tensors="torch")
    try:
        assert torch.equal(direct.submit("nobatch", {"IN": x}).result(timeout_s=30)["OUT"], x.T)
    finally:
        direct.close()
