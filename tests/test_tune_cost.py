"""The price `sluice tune` costs with, set on workers: it rides in their heartbeats and the
gateways export it per worker for the dashboard's cost panel."""

from __future__ import annotations

from pathlib import Path

from sluice.gateway.device_families import device_families
from sluice.gateway.triton_exposition import write
from sluice.shared.device_metrics import PRICE_KEY
from sluice.shared.registry import Member

from sluice.settings import ServeSettings


def test_gateways_export_each_priced_workers_price() -> None:
    priced = Member("w-a", "worker", "h", 1, 1, info={PRICE_KEY: 0.75})
    unpriced = Member("w-b", "worker", "h", 2, 1, info={})
    gateway = Member("gw", "gateway", "h", 3, 1, info={PRICE_KEY: 9.0})
    lines = write(device_families([priced, unpriced, gateway])).decode().splitlines()
    assert "# TYPE sluice_worker_price_per_hour gauge" in lines
    assert [line for line in lines if line.startswith("sluice_worker_price_per_hour")] == [
        'sluice_worker_price_per_hour{worker="w-a"} 0.75'
    ]
    assert not device_families([unpriced])  # no price given: no family at all


def test_serve_hands_its_price_to_every_worker(tmp_path: Path) -> None:
    settings = ServeSettings(model_repository=tmp_path, price_per_hour=0.75)
    assert settings.worker_settings("redis://x").config().price_per_hour == 0.75
    assert (
        ServeSettings(model_repository=tmp_path)
        .worker_settings("redis://x")
        .config()
        .price_per_hour
        is None
    )
