"""Uploaded `.npy` and `.npz` files read without trusting what their headers say.

`np.load` inflates an `.npz`'s members as it reads them and allocates whatever shape an `.npy`
header declares, so a 1 MB upload could cost GBs. Here an archive's members are summed from its
zip directory before any is read (past the limit: 413); no member is inflated past the size it
declares (the directory can lie); only stored or deflated members are read (zipfile inflates a
bzip2 or lzma chunk whole, however far it goes); an `.npy` header must describe exactly the
bytes that follow it, and an array is a view of those bytes, never a copy. Anything malformed
is a 400 naming the file or member.
"""

from __future__ import annotations

import io
import math
import zipfile
import zlib

import numpy as np
from numpy.lib import format as npy_format
from sluice.shared.errors import InvalidInput, PayloadTooLarge

#: --max-body-bytes' default: how far an archive may inflate unless told otherwise.
MAX_BYTES = 64 << 20
#: what zipfile raises for a member it cannot read: corrupt, encrypted, short, bad CRC.
_UNREADABLE = (zipfile.BadZipFile, zlib.error, OSError, EOFError, ValueError, RuntimeError)
_READABLE_METHODS = (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED)
_METHOD_NAMES = {zipfile.ZIP_BZIP2: "bzip2", zipfile.ZIP_LZMA: "lzma"}
_ZIP_MAGIC = b"PK\x03\x04"


def load_npy(data: bytes, label: str) -> np.ndarray:
    """The array an `.npy` file holds, as a read-only view of `data`; `label` names the file
    in the InvalidInput raised when it is not one, holds objects, or its header lies."""
    if data.startswith(_ZIP_MAGIC):
        raise InvalidInput(f"{label} is an .npz archive, not an .npy array")
    stream = io.BytesIO(data)
    try:
        version = npy_format.read_magic(stream)
        if version == (1, 0):
            shape, fortran_order, dtype = npy_format.read_array_header_1_0(stream)
        elif version == (2, 0):
            shape, fortran_order, dtype = npy_format.read_array_header_2_0(stream)
        else:
            raise ValueError(f"unsupported .npy format version {version[0]}.{version[1]}")
    except (ValueError, TypeError, SyntaxError) as exc:
        raise InvalidInput(f"{label} is not a valid .npy file: {exc}") from None
    if dtype.hasobject:
        raise InvalidInput(
            f"{label} holds an object array, which bulk input cannot take: save numbers or "
            "strings (numpy dtypes other than object)"
        )
    size = math.prod(shape) * dtype.itemsize
    offset = stream.tell()
    if min(shape, default=0) < 0 or len(data) - offset != size:
        raise InvalidInput(
            f"{label}: its header says shape {shape} of {dtype} ({size} bytes), but "
            f"{len(data) - offset} bytes follow it"
        )
    try:
        flat = np.frombuffer(data, dtype=dtype, count=math.prod(shape), offset=offset)
        return flat.reshape(shape, order="F" if fortran_order else "C")
    except ValueError as exc:
        raise InvalidInput(f"{label} is not a valid .npy file: {exc}") from None


def load_npz(data: bytes, max_bytes: int) -> dict[str, np.ndarray]:
    """The arrays of an `.npz` (by name, `X.npy` -> X), inflating no more than `max_bytes` in
    all: PayloadTooLarge when its directory says they would, InvalidInput when a member holds
    more than the directory says."""
    if data.startswith(npy_format.MAGIC_PREFIX):
        raise InvalidInput("bulk input is an .npy array, not an .npz archive")
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
    except _UNREADABLE as exc:
        raise InvalidInput(f"bulk input is not a valid .npz file (a zip of .npy): {exc}") from None
    with archive:
        members = archive.infolist()
        declared = sum(member.file_size for member in members)
        if declared > max_bytes:
            raise PayloadTooLarge(
                f"bulk input's arrays inflate to {declared} bytes, past the limit of "
                f"{max_bytes} bytes (--max-body-bytes)"
            )
        arrays: dict[str, np.ndarray] = {}
        for member in members:
            name = _array_name(member, arrays)
            arrays[name] = load_npy(_read_member(archive, member), f"array '{name}'")
    return arrays


def _array_name(member: zipfile.ZipInfo, seen: dict[str, np.ndarray]) -> str:
    """The input a member feeds; InvalidInput unless it is a readable `.npy` named once."""
    filename = member.filename
    if not filename.endswith(".npy"):
        raise InvalidInput(
            f"bulk input member '{filename}' is not an .npy array: an .npz holds one "
            "<input name>.npy per input"
        )
    if member.compress_type not in _READABLE_METHODS:
        method = _METHOD_NAMES.get(member.compress_type, f"method {member.compress_type}")
        raise InvalidInput(
            f"bulk input member '{filename}' is compressed with {method}: an .npz member must "
            "be stored or deflated (as numpy.savez and numpy.savez_compressed write them)"
        )
    name = filename.removesuffix(".npy")
    if name in seen:
        raise InvalidInput(f"bulk input holds array '{name}' twice")
    return name


def _read_member(archive: zipfile.ZipFile, member: zipfile.ZipInfo) -> bytes:
    """The member's bytes. zipfile inflates as much as it is asked for at a time, so asking for
    one byte past the declared size inflates no further, whatever the member holds: the sizes
    summed from the directory bound the whole read."""
    try:
        with archive.open(member) as stream:
            raw = stream.read(member.file_size + 1)
    except _UNREADABLE as exc:
        raise InvalidInput(f"bulk input member '{member.filename}' cannot be read: {exc}") from None
    if len(raw) > member.file_size:
        raise InvalidInput(
            f"bulk input member '{member.filename}' is larger than its zip directory says"
        )
    return raw
