"""Hostile bulk uploads: an `.npz` bomb is a 413 before it inflates, a broken file is a 400.

An `.npz` is a zip: a few MB can declare (or, lying, hold) GBs of arrays, and an `.npy` header
can declare a shape far larger than the bytes that follow it. None of that may cost the gateway
more memory than the upload's limit.
"""

from __future__ import annotations

import http.client
import io
import json
import struct
import tracemalloc
import zipfile
from pathlib import Path

import numpy as np
import pytest
from sluice.shared.bulk_files import read_items
from sluice.shared.errors import InvalidInput, PayloadTooLarge
from sluice.shared.signature import Signature

from tests.conftest import Service, needs_single_redis

MIB = 1 << 20
SIG = Signature.from_config(
    {
        "name": "affine",
        "max_batch_size": 64,
        "input": [{"name": "X", "data_type": "TYPE_FP32", "dims": [4]}],
        "output": [{"name": "Y", "data_type": "TYPE_FP32", "dims": [4]}],
    }
)


def _npy_header(shape: tuple[int, ...], dtype: str = "<f4") -> bytes:
    out = io.BytesIO()
    header = {"descr": dtype, "fortran_order": False, "shape": shape}
    np.lib.format.write_array_header_1_0(out, header)
    return out.getvalue()


def _bomb(size: int, method: int = zipfile.ZIP_DEFLATED) -> bytes:
    """An `.npz` whose one array `X` is `size` bytes of zeros: a few KiB per MiB on the wire."""
    out = io.BytesIO()
    with (
        zipfile.ZipFile(out, "w", method) as archive,
        archive.open("X.npy", "w") as member,
    ):
        member.write(_npy_header((size // 16, 4)))
        zeros = bytes(MIB)
        for _ in range(size // MIB):
            member.write(zeros)
    return out.getvalue()


def _lying(data: bytes, declared: int) -> bytes:
    """The archive with its one member's uncompressed size rewritten to `declared`, in the
    local header and the central directory (zip64 extra fields left alone: none here)."""
    patched = bytearray(data)
    local = patched.index(b"PK\x03\x04")
    struct.pack_into("<I", patched, local + 22, declared)
    central = patched.index(b"PK\x01\x02")
    struct.pack_into("<I", patched, central + 24, declared)
    return bytes(patched)


def _npz(**arrays: np.ndarray) -> bytes:
    out = io.BytesIO()
    np.savez(out, **arrays)
    return out.getvalue()


def _zip(**members: bytes) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return out.getvalue()


def _peak_bytes(data: bytes, fmt: str, max_bytes: int) -> tuple[Exception, int]:
    """What reading the file raised, and the most memory Python held while it did."""
    tracemalloc.start()
    try:
        with pytest.raises((InvalidInput, PayloadTooLarge)) as raised:
            read_items(data, fmt, SIG, max_bytes=max_bytes)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return raised.value, peak


def test_an_npz_bomb_is_refused_from_its_zip_directory_before_inflating() -> None:
    error, peak = _peak_bytes(_bomb(64 * MIB), "npz", max_bytes=MIB)
    assert isinstance(error, PayloadTooLarge)
    assert str(error) == (
        f"bulk input's arrays inflate to {64 * MIB + 128} bytes, past the limit of {MIB} bytes "
        "(--max-body-bytes)"
    )
    assert peak < MIB


@pytest.mark.parametrize("method", [zipfile.ZIP_DEFLATED, zipfile.ZIP_STORED])
def test_a_zip_directory_that_lies_about_sizes_inflates_no_further(method: int) -> None:
    error, peak = _peak_bytes(_lying(_bomb(16 * MIB, method), 1000), "npz", max_bytes=MIB)
    assert isinstance(error, InvalidInput)
    assert "member 'X.npy' cannot be read" in str(error)
    assert peak < 3 * MIB


@pytest.mark.parametrize(
    ("method", "name"), [(zipfile.ZIP_BZIP2, "bzip2"), (zipfile.ZIP_LZMA, "lzma")]
)
def test_members_compressed_other_than_by_deflate_are_refused_unread(
    method: int, name: str
) -> None:
    """zipfile inflates a bzip2 or lzma chunk whole, however far it inflates: not bounded."""
    error, peak = _peak_bytes(_bomb(16 * MIB, method), "npz", max_bytes=32 * MIB)
    assert isinstance(error, InvalidInput)
    assert str(error) == (
        f"bulk input member 'X.npy' is compressed with {name}: an .npz member must be stored "
        "or deflated (as numpy.savez and numpy.savez_compressed write them)"
    )
    assert peak < MIB


def test_an_npy_header_larger_than_its_data_allocates_nothing() -> None:
    """np.load would allocate the declared shape (40 GB here) before finding the data short."""
    small = _npy_header((10_000_000_000, 4)) + bytes(64)
    for data, fmt in ((small, "npy"), (_zip(**{"X.npy": small}), "npz")):
        error, peak = _peak_bytes(data, fmt, max_bytes=MIB)
        assert isinstance(error, InvalidInput)
        assert "says shape (10000000000, 4) of float32 (160000000000 bytes)" in str(error)
        assert "64 bytes follow it" in str(error)
        assert peak < MIB


def test_arrays_inflating_to_exactly_the_limit_are_read() -> None:
    x = np.ones((8, 4), np.float32)
    data = _npz(X=x)
    inflated = sum(m.file_size for m in zipfile.ZipFile(io.BytesIO(data)).infolist())
    assert len(read_items(data, "npz", SIG, max_bytes=inflated)) == 8
    with pytest.raises(PayloadTooLarge):
        read_items(data, "npz", SIG, max_bytes=inflated - 1)


@pytest.mark.parametrize(
    ("data", "fmt", "message"),
    [
        (b"PK\x03\x04 not really a zip", "npz", "bulk input is not a valid .npz file"),
        (b"", "npz", "bulk input is not a valid .npz file"),
        (_npz(X=np.zeros((2, 4), np.float32))[:-30], "npz", "bulk input is not a valid .npz"),
        (_npz(X=np.array([[1, "a"]] * 2, dtype=object)), "npz", "array 'X' holds an object"),
        (
            _npy_header((2,), "|O") + bytes(16),
            "npy",
            "bulk input holds an object array",
        ),
        (_zip(**{"X.txt": b"1 2 3 4"}), "npz", "member 'X.txt' is not an .npy array"),
        (_zip(**{"X.npy": b"not npy"}), "npz", "array 'X' is not a valid .npy file"),
        (_zip(**{"X.npy": b"\x93NUMPY\x01\x00\x10\x00{'descr': 3}   \n"}), "npz", "array 'X'"),
        (_zip(**{"X.npy": _npy_header((-2, 4))}), "npz", "array 'X'"),
        (_npy_header((2, 4)) + bytes(8), "npy", "bulk input: its header says shape (2, 4)"),
        (_npz(X=np.zeros((2, 4), np.float32)), "npy", "an .npz archive, not an .npy"),
        (_npy_header((2, 4)) + bytes(32), "npz", "an .npy array, not an .npz archive"),
    ],
)
def test_a_malformed_upload_is_a_400_naming_what_is_wrong(
    data: bytes, fmt: str, message: str
) -> None:
    with pytest.raises(InvalidInput) as raised:
        read_items(data, fmt, SIG)
    assert message in raised.value.message


def test_a_fortran_ordered_npy_is_read_in_its_order() -> None:
    x = np.asfortranarray(np.arange(12, dtype=np.float32).reshape(3, 4))
    out = io.BytesIO()
    np.save(out, x)
    items = read_items(out.getvalue(), "npy", SIG)
    assert np.frombuffer(items[1].inputs[0].data, np.float32).tolist() == x[1].tolist()


# --- against `sluice serve` ---------------------------------------------------------------


def _post(service: Service, path: str, body: bytes) -> tuple[int, str]:
    host, port = service.http_url.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", path, body=body)
    response = conn.getresponse()
    message = json.loads(response.read())["error"]
    conn.close()
    return response.status, message


def _peak_rss(pid: int) -> int:
    """The process's peak resident memory so far, in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


@needs_single_redis
def test_the_gateway_answers_an_npz_bomb_with_413_and_stays_small(service: Service) -> None:
    bomb = _bomb(512 * MIB)  # 8 x the default --max-body-bytes, about 0.5 MB on the wire
    lie = _lying(_bomb(256 * MIB), 1 << 20)
    warm_up = _npz(X=np.zeros((1, 4), np.float64))  # the gateway's first bulk upload
    assert _post(service, "/v2/models/affine/bulk?format=npz", warm_up)[0] == 400
    before = _peak_rss(service.process.pid)
    status, message = _post(service, "/v2/models/affine/bulk?format=npz&id=bomb", bomb)
    assert (status, message) == (
        413,
        f"bulk input's arrays inflate to {512 * MIB + 128} bytes, past the limit of "
        f"{64 * MIB} bytes (--max-body-bytes)",
    )
    status, message = _post(service, "/v2/models/affine/bulk?format=npz&id=lie", lie)
    assert status == 400 and "member 'X.npy'" in message
    assert _peak_rss(service.process.pid) - before < 16 * MIB


@needs_single_redis
@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"this is no zip", "bulk input is not a valid .npz file"),
        (_npz(X=np.array([[1, "a"]] * 2, dtype=object)), "array 'X' holds an object array"),
    ],
)
def test_the_gateway_answers_a_broken_npz_with_400(
    service: Service, body: bytes, message: str
) -> None:
    status, got = _post(service, "/v2/models/affine/bulk?format=npz", body)
    assert status == 400 and message in got
