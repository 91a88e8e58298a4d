"""Triton's system shared-memory extension: regions of the client's POSIX shared memory that
requests read inputs from and write outputs to, instead of carrying the tensors.

A region lives on the client's host, so it is the gateway on that host that maps it (a sidecar
gateway per client host is the deployment that saves the copies); regions are this gateway's
own, never the fleet's. A key from the wire reaches the filesystem only as a plain name in
/dev/shm (`/name`, no other slash), and a gateway maps at most `MAX_REGIONS` of them.
Triton's texts and statuses throughout.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sluice.shared.errors import InvalidInput, SluiceError
from sluice.shared.infer_codec import SharedMemorySpan
from sluice.shared.protocol import Tensor

#: where Linux keeps POSIX shared memory objects (shm_open's namespace).
SHM_ROOT = Path("/dev/shm")
#: a shm_open name as a client gives it: a slash, then a plain file name.
_KEY = re.compile(r"/[A-Za-z0-9._-]{1,250}")
#: regions one gateway maps at most.
MAX_REGIONS = 1024


class AlreadyExists(SluiceError):
    code = "ALREADY_EXISTS"
    http_status = 400


class RegionNotFound(SluiceError):
    code = "NOT_FOUND"
    http_status = 404


@dataclass(slots=True)
class _Region:
    name: str
    key: str
    offset: int
    byte_size: int
    mapping: mmap.mmap

    def status(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "key": self.key,
            "offset": self.offset,
            "byte_size": self.byte_size,
        }


class SystemSharedMemory:
    """This gateway's registered regions, by name."""

    def __init__(self) -> None:
        self._regions: dict[str, _Region] = {}

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        if not name:
            raise InvalidInput("'region name' is necessary to register system shared memory region")
        if name in self._regions:
            raise AlreadyExists(f"shared memory region '{name}' already in manager")
        if len(self._regions) >= MAX_REGIONS:
            raise InvalidInput(f"a gateway maps at most {MAX_REGIONS} shared memory regions")
        if not _KEY.fullmatch(key):
            raise SluiceError(f"Unable to open shared memory region: '{key}'")
        try:
            fd = os.open(SHM_ROOT / key[1:], os.O_RDWR)
        except OSError:
            raise SluiceError(f"Unable to open shared memory region: '{key}'") from None
        try:
            size = os.fstat(fd).st_size
            if offset < 0 or byte_size < 0 or offset + byte_size > size or not size:
                raise SluiceError(f"Invalid shared memory region: '{key}'")
            mapping = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._regions[name] = _Region(name, key, offset, byte_size, mapping)

    def status(self, name: str | None) -> list[dict[str, Any]]:
        """Every region's (name None), or the one named."""
        if name is None:
            return [region.status() for region in self._regions.values()]
        region = self._regions.get(name)
        if region is None:
            raise RegionNotFound(f"Unable to find system shared memory region: '{name}'")
        return [region.status()]

    def unregister(self, name: str | None) -> None:
        """Unmap one region (an unknown name is no error, as in Triton), or every one."""
        if name is None:
            regions = list(self._regions.values())
        else:
            regions = [self._regions[name]] if name in self._regions else []
        for region in regions:
            try:
                region.mapping.close()
            except BufferError:  # a request still reads or writes it
                raise SluiceError(
                    f"Cannot unregister shared memory region '{region.name}', it is currently "
                    "in use."
                ) from None
            del self._regions[region.name]

    def read(self, name: str, offset: int, byte_size: int) -> memoryview:
        """`byte_size` bytes of a region from `offset`: an input's data, not copied."""
        region = self._span(name, offset, byte_size)
        start = region.offset + offset
        return memoryview(region.mapping)[start : start + byte_size]

    def write(self, name: str, offset: int, byte_size: int, output: str, data: Any) -> None:
        """An output's bytes into a region, which must hold them."""
        region = self._span(name, offset, byte_size)
        size = data.nbytes if isinstance(data, memoryview) else len(data)
        if size > byte_size:
            raise SluiceError(
                f"shared memory size specified with the request for output '{output}' "
                f"({byte_size} bytes) should be at least {size} bytes to hold the results"
            )
        start = region.offset + offset
        region.mapping[start : start + size] = data

    def write_outputs(
        self, spans: Mapping[str, SharedMemorySpan], outputs: Sequence[Tensor]
    ) -> None:
        """The outputs a request asked to have written into shared memory (`spans`)."""
        if not spans:  # the usual request: nothing to look up per output
            return
        for tensor in outputs:
            span = spans.get(tensor.name)
            if span is not None:
                self.write(span.region, span.offset, span.byte_size, tensor.name, tensor.data)

    def _span(self, name: str, offset: int, byte_size: int) -> _Region:
        region = self._regions.get(name)
        if region is None:
            raise RegionNotFound(f"Unable to find shared memory region: '{name}'")
        if offset < 0 or offset >= region.byte_size:
            raise InvalidInput(f"Invalid offset for shared memory region: '{name}'")
        if byte_size < 0 or offset + byte_size > region.byte_size:
            raise InvalidInput(f"Invalid offset + byte size for shared memory region: '{name}'")
        return region

    def close(self) -> None:
        for region in self._regions.values():
            with contextlib.suppress(BufferError):  # a request still holds it: unmapped when done
                region.mapping.close()
        self._regions.clear()
