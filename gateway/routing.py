"""A route table: method and path pattern -> endpoint, matched in one place (as starlette's
`Route` list), so that the API's shape reads as a list instead of a ladder of path tests.

Patterns are matched against the path without its outer slashes. `{name}` is one path
segment (possibly empty), passed to the endpoint by name; a trailing `/**` takes any further
segments, which the endpoint ignores. Routes are tried in order, so put the busiest first and
catch-alls last; a route whose methods do not include the request's is skipped, and a path that
only such routes match goes to the router's `not_allowed` endpoint (HTTP's 405). What a method
and path matched is remembered (a dict lookup instead of the patterns on the hot path), so
endpoints must not change the parameters they are given.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from sluice.shared.http_messages import HttpRequest, HttpResponse

Endpoint = Callable[[HttpRequest, dict[str, str]], Awaitable[HttpResponse]]
Match = tuple[Endpoint, dict[str, str]]
_PARAMETER = re.compile(r"\{(\w+)\}")
#: distinct method and path pairs remembered at most (paths are the clients' to choose).
MAX_REMEMBERED = 1024


def _compile(pattern: str) -> re.Pattern[str]:
    tail = pattern.endswith("/**")
    fixed = pattern[:-3] if tail else pattern
    parts = _PARAMETER.split(fixed)  # literal, name, literal, name, ..., literal
    regex = "".join(
        re.escape(part) if i % 2 == 0 else f"(?P<{part}>[^/]*)" for i, part in enumerate(parts)
    )
    return re.compile(regex + ("(?:/.*)?" if tail else ""), re.DOTALL)


@dataclass(frozen=True, slots=True)
class Route:
    pattern: str
    endpoint: Endpoint
    #: the methods it answers; None: any.
    methods: frozenset[str] | None = None
    regex: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "regex", _compile(self.pattern))


class Router:
    def __init__(self, routes: Sequence[Route], not_allowed: Endpoint | None = None) -> None:
        self.routes = tuple(routes)
        self.not_allowed = not_allowed
        self._remembered: dict[tuple[str, str], Match | None] = {}

    def match(self, method: str, path: str) -> Match | None:
        """The first route for `method` whose pattern matches `path`, with its parameters."""
        key = (method, path)
        try:
            return self._remembered[key]
        except KeyError:
            pass
        if len(self._remembered) >= MAX_REMEMBERED:
            self._remembered.clear()
        found = self._remembered[key] = self._search(method, path)
        return found

    def _search(self, method: str, path: str) -> Match | None:
        subject = path.strip("/")
        other_method = False
        for route in self.routes:
            found = route.regex.fullmatch(subject)
            if found is None:
                continue
            if route.methods is not None and method not in route.methods:
                other_method = True
                continue
            return route.endpoint, found.groupdict()
        if other_method and self.not_allowed is not None:
            return self.not_allowed, {}
        return None
