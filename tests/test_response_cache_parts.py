"""The response cache's parts: --cache-config, the request key, the local LRU, entries."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from sluice.gateway.response_cache.cache_config import parse_cache_config
from sluice.gateway.response_cache.entry import pack_entry, unpack_entry
from sluice.gateway.response_cache.local_store import ENTRY_OVERHEAD, LocalStore
from sluice.gateway.response_cache.request_key import request_key
from sluice.shared.protocol import Tensor
from sluice.shared.response_cache_rules import cache_enabled, cache_problem


def _tensor(name: str, values: list[int], datatype: str = "INT32") -> Tensor:
    array = np.array(values, dtype=np.int32 if datatype == "INT32" else np.float32)
    return Tensor(name, datatype, (1, len(values)), array.tobytes())


def test_cache_config_takes_tritons_form_and_merges_repeats() -> None:
    assert parse_cache_config(()) is None
    local = parse_cache_config(("local,size=1048576",))
    assert local is not None and (local.cache, local.local_size) == ("local", 1048576)
    redis = parse_cache_config(("redis,host=cache.internal", "redis,port=6380,ttl=30"))
    assert redis is not None and redis.ttl_s == 30
    assert redis.redis_url("redis://fleet:6379/0") == "redis://cache.internal:6380/0"
    fleet = parse_cache_config(("redis",))
    assert fleet is not None and fleet.redis_url("redis://fleet:6379/0") == "redis://fleet:6379/0"


@pytest.mark.parametrize(
    ("specs", "message"),
    [
        (("local",), "the local cache needs size=<bytes>"),
        (("local,size=10",), "at least 1024 bytes"),
        (("local,size=big",), "size must be an integer, got 'big'"),
        (("memcached,size=1",), "unknown cache 'memcached'"),
        (("local,size=2048", "redis"), "one cache at a time"),
        (("redis,host=h",), "host and port together"),
        (("redis,colour=blue",), "unknown redis cache setting(s): colour"),
        (("redis,ttl",), "'ttl' in 'redis,ttl' is not <key>=<value>"),
    ],
)
def test_cache_config_names_what_is_wrong(specs: tuple[str, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_cache_config(specs)


def test_the_key_is_the_tensors_not_their_order_or_encoding() -> None:
    a, b = _tensor("A", [1, 2]), _tensor("B", [3, 4])
    key = request_key("m", 1, [a, b], None)
    assert request_key("m", 1, [b, a], None) == key
    assert request_key("m", 1, [a, Tensor("B", "INT32", (1, 2), memoryview(b.data))], None) == key
    assert request_key("m", 2, [a, b], None) != key
    assert request_key("n", 1, [a, b], None) != key
    assert request_key("m", 1, [a, _tensor("B", [3, 5])], None) != key
    reshaped = Tensor("B", "INT32", (2, 1), b.data)
    assert request_key("m", 1, [a, reshaped], None) != key
    assert request_key("m", 1, [a, b], ["OUT"]) != key
    assert request_key("m", 1, [a, b], ["X", "Y"]) == request_key("m", 1, [a, b], ["Y", "X"])


def test_the_local_store_evicts_the_least_recently_used_within_its_size() -> None:
    async def run() -> None:
        entry = b"x" * 100
        store = LocalStore(3 * (len(entry) + ENTRY_OVERHEAD))
        for key in (b"a", b"b", b"c"):
            await store.put(key, entry)
        assert await store.get(b"a") == entry  # a is now the most recently used
        await store.put(b"d", entry)
        assert await store.get(b"b") is None
        assert [await store.get(k) is not None for k in (b"a", b"c", b"d")] == [True] * 3
        assert store.used <= store.size
        assert (store.counts.evictions, store.counts.hits, store.counts.misses) == (1, 4, 1)
        await store.put(b"big", b"y" * store.size)  # larger than the cache: not kept
        assert await store.get(b"big") is None
        assert len(store) == 3

    asyncio.run(run())


def test_an_entry_keeps_outputs_and_parameters() -> None:
    outputs = [_tensor("OUT", [1, 2, 3]), Tensor("S", "BYTES", (1,), b"\x02\x00\x00\x00hi")]
    unpacked, parameters = unpack_entry(pack_entry(outputs, {"note": "x", "n": 3}))
    assert [(t.name, t.datatype, t.shape, bytes(t.data)) for t in unpacked] == [
        (t.name, t.datatype, t.shape, bytes(t.data)) for t in outputs
    ]
    assert parameters == {"note": "x", "n": 3}


def test_models_that_cannot_be_cached_are_refused_in_tritons_words() -> None:
    base = {"name": "m", "response_cache": {"enable": True}}
    assert cache_enabled(base) and cache_problem(base) is None
    assert not cache_enabled({"name": "m"})
    decoupled = {**base, "model_transaction_policy": {"decoupled": True}}
    assert cache_problem(decoupled) == (
        "Response Cache does not currently support model m with 'decoupled' transaction "
        "policy. Please disable the response cache."
    )
    sequence = {**base, "sequence_batching": {}}
    assert cache_problem(sequence) == (
        "Response Cache does not currently support model m with sequence batching scheduler. "
        "Please disable the response cache."
    )
    assert cache_problem({**decoupled, "response_cache": {"enable": False}}) is None
