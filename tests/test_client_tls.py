"""The SDK over https: TLS with certificate and hostname checks, against a TLS-terminating proxy
on loopback in front of a live gateway; URL schemes and default ports."""

from __future__ import annotations

import asyncio
import shutil
import ssl
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from sluice.client import AsyncClient, Client
from sluice.client._http import split_url
from tests.conftest import Service

X = np.arange(6, dtype=np.float32).reshape(2, 3)


def _self_signed(directory: Path, name: str) -> tuple[str, str]:
    """A certificate for `localhost` only (not 127.0.0.1), and its key."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("needs openssl on PATH")
    cert, key = str(directory / f"{name}.pem"), str(directory / f"{name}.key")
    make_cert = (openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1")
    names = ("-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost")
    subprocess.run(
        [*make_cert, *names, "-keyout", key, "-out", cert],
        check=True,
        capture_output=True,
    )
    return cert, key


class TlsProxy:
    """Terminates TLS on a loopback port and relays the bytes to a plain HTTP server."""

    def __init__(self, cert: str, key: str, target: str) -> None:
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.context.load_cert_chain(cert, key)
        host, port = target.split(":")
        self.target = (host, int(port))
        self.loop = asyncio.new_event_loop()
        self.port = self.loop.run_until_complete(self._start())
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    async def _start(self) -> int:
        self.server = await asyncio.start_server(self._relay, "127.0.0.1", 0, ssl=self.context)
        return int(self.server.sockets[0].getsockname()[1])

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream_reader, upstream_writer = await asyncio.open_connection(*self.target)

        async def pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
            try:
                while data := await source.read(65536):
                    sink.write(data)
                    await sink.drain()
            finally:
                sink.close()

        await asyncio.gather(
            pipe(reader, upstream_writer), pipe(upstream_reader, writer), return_exceptions=True
        )

    def close(self) -> None:
        async def stop() -> None:
            self.server.close()
            self.loop.stop()

        self.loop.call_soon_threadsafe(lambda: self.loop.create_task(stop()))
        self.thread.join(10)
        self.loop.close()


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, str]]:
    directory = tmp_path_factory.mktemp("tls")
    return {name: _self_signed(directory, name) for name in ("server", "other")}


@pytest.fixture(scope="module")
def proxy(service: Service, certs: dict[str, tuple[str, str]]) -> Iterator[TlsProxy]:
    tls = TlsProxy(*certs["server"], service.http_url)
    yield tls
    tls.close()


def test_infer_over_https_with_the_servers_ca(
    proxy: TlsProxy, certs: dict[str, tuple[str, str]]
) -> None:
    with Client(f"https://localhost:{proxy.port}", ca_file=certs["server"][0]) as client:
        np.testing.assert_array_equal(client.infer("nobatch", {"IN": X})["OUT"], X.T)
        job = client.submit("nobatch", {"IN": X})
        np.testing.assert_array_equal(job.result(timeout_s=30)["OUT"], X.T)


async def test_async_infer_over_https_with_an_ssl_context(
    proxy: TlsProxy, certs: dict[str, tuple[str, str]]
) -> None:
    context = ssl.create_default_context(cafile=certs["server"][0])
    async with AsyncClient(f"https://localhost:{proxy.port}", ssl_context=context) as client:
        np.testing.assert_array_equal((await client.infer("nobatch", {"IN": X}))["OUT"], X.T)


@pytest.mark.parametrize(
    ("host", "ca"), [("localhost", "other"), ("localhost", None), ("127.0.0.1", "server")]
)
def test_a_certificate_that_does_not_verify_is_refused(
    proxy: TlsProxy, certs: dict[str, tuple[str, str]], host: str, ca: str | None
) -> None:
    ca_file = certs[ca][0] if ca else None  # None: the system's CAs
    client = Client(f"https://{host}:{proxy.port}", ca_file=ca_file)
    with client, pytest.raises(ssl.SSLCertVerificationError):
        client.infer("nobatch", {"IN": X})


async def test_the_async_client_refuses_a_wrong_ca_too(
    proxy: TlsProxy, certs: dict[str, tuple[str, str]]
) -> None:
    async with AsyncClient(f"https://localhost:{proxy.port}", ca_file=certs["other"][0]) as c:
        with pytest.raises(ssl.SSLCertVerificationError):
            await c.infer("nobatch", {"IN": X})


@pytest.mark.parametrize(
    ("url", "endpoint"),
    [
        ("https://gw.example", ("https", "gw.example", 443)),
        ("https://gw.example:8443", ("https", "gw.example", 8443)),
        ("http://gw.example", ("http", "gw.example", 8000)),
        ("gw.example", ("http", "gw.example", 8000)),
        ("gw.example:9000", ("http", "gw.example", 9000)),
        ("HTTPS://GW.example", ("https", "gw.example", 443)),
    ],
)
def test_schemes_and_default_ports(url: str, endpoint: tuple[str, str, int]) -> None:
    assert split_url(url) == endpoint


@pytest.mark.parametrize("url", ["ftp://gw.example", "redis://gw.example:6379", "ws://gw"])
def test_an_unknown_scheme_is_refused(url: str) -> None:
    with pytest.raises(ValueError, match="use http:// or https://"):
        Client(url)
    with pytest.raises(ValueError, match="use http:// or https://"):
        AsyncClient(url)


def test_tls_options_need_an_https_url(certs: dict[str, tuple[str, str]]) -> None:
    with pytest.raises(ValueError, match="https://"):
        Client("http://gw.example", ca_file=certs["server"][0])
