"""Triton's system shared-memory extension at the gateway, over HTTP and gRPC, with
tritonclient's own shared-memory utilities: inputs read from the client's regions, outputs
written into them, and Triton's errors."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from tests.conftest import Service, serving_alone

HERE = Path(__file__).parent
BYTES = 64  # one [1, 16] INT32 tensor


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    repo = tmp_path_factory.mktemp("repo")
    shutil.copytree(HERE / "triton_examples_repo" / "simple", repo / "simple")
    with serving_alone(repo) as service:
        yield service


@pytest.fixture
def regions() -> Iterator[dict[str, Any]]:
    """An input region holding INPUT0 then INPUT1, and an output region for both outputs."""
    made = {
        "in": shm.create_shared_memory_region("in", "/sluice_test_in", 2 * BYTES),
        "out": shm.create_shared_memory_region("out", "/sluice_test_out", 2 * BYTES),
    }
    shm.set_shared_memory_region(
        made["in"], [np.arange(16, dtype=np.int32).reshape(1, 16), np.ones((1, 16), np.int32)]
    )
    yield made
    for handle in made.values():
        shm.destroy_shared_memory_region(handle)


def _requests(module: Any) -> tuple[list[Any], list[Any]]:
    """Both inputs and both outputs in shared memory (`module`: tritonclient.http or .grpc)."""
    inputs = [module.InferInput(f"INPUT{i}", [1, 16], "INT32") for i in range(2)]
    outputs = [module.InferRequestedOutput(f"OUTPUT{i}") for i in range(2)]
    for i in range(2):
        inputs[i].set_shared_memory("in", BYTES, offset=i * BYTES)
        outputs[i].set_shared_memory("out", BYTES, offset=i * BYTES)
    return inputs, outputs


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_inputs_and_outputs_travel_through_the_clients_shared_memory(
    served: Service, regions: dict[str, Any], protocol: str
) -> None:
    module: Any = httpclient if protocol == "http" else grpcclient
    client = module.InferenceServerClient(
        served.http_url if protocol == "http" else served.grpc_url
    )
    try:
        client.unregister_system_shared_memory()
        client.register_system_shared_memory("in", "/sluice_test_in", 2 * BYTES)
        client.register_system_shared_memory("out", "/sluice_test_out", 2 * BYTES)
        inputs, outputs = _requests(module)
        result = client.infer("simple", inputs, outputs=outputs)
        # the outputs are not in the response, but in the region
        if protocol == "http":
            assert "data" not in result.get_output("OUTPUT0")
        else:
            assert list(result.get_response().raw_output_contents) == [b"", b""]
        total = shm.get_contents_as_numpy(regions["out"], np.int32, [1, 16])
        difference = shm.get_contents_as_numpy(regions["out"], np.int32, [1, 16], offset=BYTES)
        assert total.tolist() == [[i + 1 for i in range(16)]]
        assert difference.tolist() == [[i - 1 for i in range(16)]]
        status = client.get_system_shared_memory_status()
        names = {r["name"] for r in status} if protocol == "http" else set(status.regions.keys())
        assert names == {"in", "out"}
    finally:
        client.unregister_system_shared_memory()
        client.close()


def test_tritons_errors_for_regions_and_their_bounds(
    served: Service, regions: dict[str, Any]
) -> None:
    client = httpclient.InferenceServerClient(served.http_url)
    try:
        client.unregister_system_shared_memory()
        client.register_system_shared_memory("in", "/sluice_test_in", 2 * BYTES)

        def refused(call: Any) -> str:
            with pytest.raises(InferenceServerException) as err:
                call()
            return str(err.value.message())

        assert refused(
            lambda: client.register_system_shared_memory("in", "/sluice_test_in", BYTES)
        ) == ("shared memory region 'in' already in manager")
        # a key from the wire never leaves /dev/shm
        assert refused(
            lambda: client.register_system_shared_memory("x", "/../etc/passwd", BYTES)
        ) == ("Unable to open shared memory region: '/../etc/passwd'")
        assert refused(
            lambda: client.register_system_shared_memory("x", "/sluice_test_in", 4 * BYTES)
        ) == ("Invalid shared memory region: '/sluice_test_in'")
        assert refused(lambda: client.get_system_shared_memory_status("nope")) == (
            "Unable to find system shared memory region: 'nope'"
        )
        inputs, outputs = _requests(httpclient)
        assert refused(lambda: client.infer("simple", inputs, outputs=outputs)) == (
            "Unable to find shared memory region: 'out'"
        )
        inputs[1].set_shared_memory("in", BYTES, offset=2 * BYTES)
        assert refused(lambda: client.infer("simple", inputs)) == (
            "Invalid offset for shared memory region: 'in'"
        )
        inputs[1].set_shared_memory("in", 2 * BYTES, offset=BYTES)
        assert refused(lambda: client.infer("simple", inputs)) == (
            "Invalid offset + byte size for shared memory region: 'in'"
        )
        client.register_system_shared_memory("out", "/sluice_test_out", 2 * BYTES)
        inputs, outputs = _requests(httpclient)
        outputs[0].set_shared_memory("out", 8)
        assert refused(lambda: client.infer("simple", inputs, outputs=outputs)) == (
            "shared memory size specified with the request for output 'OUTPUT0' (8 bytes) "
            "should be at least 64 bytes to hold the results"
        )
    finally:
        client.unregister_system_shared_memory()
        client.close()
