"""`--cache-config`, as Triton 2.51 takes it: `<cache>,<key>=<value>`, repeatable.

Triton loads a cache library by name; sluice has two: `local` (an LRU of `size` bytes in each
gateway) and `redis` (one cache for the whole fleet, on the fleet's Redis unless `host` and
`port` name another). Repeating the flag for one cache adds keys to it, as Triton merges them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: the caches sluice has, as Triton names its libraries.
CACHES = ("local", "redis")
#: seconds a Redis entry lives, unless `ttl` says otherwise: Redis holds the fleet's queues,
#: so entries must leave on their own (a dedicated Redis may run an LRU policy instead).
DEFAULT_TTL_S = 600
#: the largest response a Redis cache stores (`max_entry_bytes`); larger ones go uncached.
DEFAULT_MAX_ENTRY_BYTES = 4 << 20
#: Triton's local cache fails to start below about 1 KiB.
MIN_LOCAL_SIZE = 1024

_LOCAL_KEYS = frozenset({"size"})
_REDIS_KEYS = frozenset(
    {"host", "port", "db", "user", "password", "ttl", "max_entry_bytes", "tls_enabled"}
    | {"connect_timeout", "socket_timeout", "pool_size", "wait_timeout"}
)


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """The one cache a gateway runs, and its settings as given (strings, as Triton passes)."""

    cache: str
    options: dict[str, str] = field(default_factory=dict)

    @property
    def local_size(self) -> int:
        return _integer(self.options, "size", None)

    @property
    def ttl_s(self) -> int:
        return _integer(self.options, "ttl", DEFAULT_TTL_S)

    @property
    def max_entry_bytes(self) -> int:
        return _integer(self.options, "max_entry_bytes", DEFAULT_MAX_ENTRY_BYTES)

    def redis_url(self, fleet_url: str) -> str:
        """The URL of the Redis the cache lives on: the fleet's unless `host` names one."""
        host = self.options.get("host")
        if host is None:
            return fleet_url
        scheme = "rediss" if self.options.get("tls_enabled", "").lower() == "true" else "redis"
        user, password = self.options.get("user", ""), self.options.get("password", "")
        login = f"{user}:{password}@" if password else ""
        return f"{scheme}://{login}{host}:{self.options['port']}/{self.options.get('db', '0')}"


def parse_cache_config(specs: tuple[str, ...]) -> CacheConfig | None:
    """The cache the flags configure (None: no cache); ValueError names what is wrong."""
    caches: dict[str, dict[str, str]] = {}
    for spec in specs:
        cache, _, rest = spec.partition(",")
        cache = cache.strip()
        if cache not in CACHES:
            raise ValueError(f"unknown cache '{cache}' in '{spec}' (sluice has: local, redis)")
        options = caches.setdefault(cache, {})
        for pair in filter(None, (p.strip() for p in rest.split(","))):
            key, sep, value = pair.partition("=")
            if not sep or not key:
                raise ValueError(f"'{pair}' in '{spec}' is not <key>=<value>")
            options[key.strip()] = value.strip()
    if not caches:
        return None
    if len(caches) > 1:
        raise ValueError(f"one cache at a time, got {', '.join(sorted(caches))}")
    ((cache, options),) = caches.items()
    config = CacheConfig(cache, options)
    _check(config)
    return config


def _check(config: CacheConfig) -> None:
    allowed = _LOCAL_KEYS if config.cache == "local" else _REDIS_KEYS
    unknown = sorted(set(config.options) - allowed)
    if unknown:
        raise ValueError(f"unknown {config.cache} cache setting(s): {', '.join(unknown)}")
    if config.cache == "local":
        if "size" not in config.options:
            raise ValueError("the local cache needs size=<bytes>")
        if config.local_size < MIN_LOCAL_SIZE:
            raise ValueError(f"the local cache's size must be at least {MIN_LOCAL_SIZE} bytes")
        return
    if ("host" in config.options) != ("port" in config.options):
        raise ValueError("the redis cache needs host and port together (neither: the fleet's)")
    _integer(config.options, "port", 0)
    _integer(config.options, "db", 0)
    if config.ttl_s < 1:
        raise ValueError("the redis cache's ttl must be at least 1 second")
    if config.max_entry_bytes < 1:
        raise ValueError("the redis cache's max_entry_bytes must be at least 1")


def _integer(options: dict[str, str], key: str, default: int | None) -> int:
    text = options.get(key)
    if text is None:
        assert default is not None, key
        return default
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"cache setting {key} must be an integer, got '{text}'") from None
