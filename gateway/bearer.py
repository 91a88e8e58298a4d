"""`Authorization: Bearer <token>`, checked the same way on every port that asks for one."""

from __future__ import annotations

import hmac

from sluice.shared.errors import Unauthorized
from sluice.shared.http_messages import HttpRequest, HttpResponse, error_response
from sluice.shared.http_server import Handler

SCHEME = b"bearer"
REFUSAL = "missing or invalid bearer token (Authorization: Bearer ...)"


def bearer_matches(given: bytes | str | None, token: bytes) -> bool:
    """Whether an Authorization value carries `token`: the scheme word in any case (RFC 9110
    makes it case-insensitive, and clients send `bearer` too), then the token, compared in
    constant time."""
    if given is None:
        return False
    raw = given.encode() if isinstance(given, str) else given
    scheme, _, credentials = raw.partition(b" ")
    if scheme.lower() != SCHEME:
        return False
    return hmac.compare_digest(credentials.lstrip(b" "), token)


class BearerGuard:
    """An HTTP handler that answers 401 to a request without the token and hands the others to
    `handler` (the metrics port under --metrics-auth-token)."""

    def __init__(self, handler: Handler, token: str) -> None:
        self.handler = handler
        self.token = token.encode()

    def precheck(self, method: str, path: str, headers: dict[bytes, bytes]) -> HttpResponse | None:
        """The 401, or None; also what the server asks before an `Expect: 100-continue` body."""
        if bearer_matches(headers.get(b"authorization"), self.token):
            return None
        return error_response(Unauthorized(REFUSAL))

    async def __call__(self, request: HttpRequest) -> HttpResponse:
        refusal = self.precheck(request.method, request.path, request.headers)
        return refusal if refusal is not None else await self.handler(request)
