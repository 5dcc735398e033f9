"""Retry-After on the refusals a client should simply retry: the HTTP door's 429 overloaded and 503
draining carry the header, and the msgpack door's overloaded error its retry_after_s (a small constant,
OVERLOADED_RETRY_S); rate_limited keeps the quota's own estimate."""

import pytest

from minisarathi.server.protocol import (
    ABORTED,
    INVALID_PARAMS,
    OVERLOADED,
    OVERLOADED_RETRY_S,
    RATE_LIMITED,
    RPCError,
)

http = pytest.importorskip("minisarathi.server.http", reason="the http extra is needed")


def test_the_msgpack_error_carries_the_hint():
    assert RPCError(OVERLOADED, "server queue is full (1 requests)").to_wire() == {
        "code": OVERLOADED,
        "message": "server queue is full (1 requests)",
        "retry_after_s": OVERLOADED_RETRY_S,
    }
    assert RPCError(RATE_LIMITED, "over the quota", retry_after_s=12.5).to_wire()["retry_after_s"] == 12.5
    assert "retry_after_s" not in RPCError(INVALID_PARAMS, "max_tokens ...").to_wire()


@pytest.mark.parametrize(
    "error, accepting, status, retry_after",
    [
        (RPCError(OVERLOADED, "server queue is full (1 requests)"), True, 429, "1"),
        (RPCError(OVERLOADED, "server is shutting down"), False, 503, "1"),
        (RPCError(ABORTED, "the server is shutting down"), True, 503, "1"),
        (RPCError(RATE_LIMITED, "over the quota", retry_after_s=2.2), True, 429, "3"),
        (RPCError(INVALID_PARAMS, "max_tokens must be >= 1"), True, 400, None),
    ],
)
def test_the_http_refusals_carry_retry_after(error, accepting, status, retry_after):
    response = http._error_response(http._from_rpc(error, accepting))
    assert response.status == status and response.headers.get("Retry-After") == retry_after
