"""Per-connection options (the msgpack door's `options` call, docs/protocol.md "Other clients") for clients
that read only part of the protocol: Neovim's rpcrequest shows an error that is not a string as "unknown
error", and some clients break on any notification."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from minisarathi.server.protocol import INVALID_PARAMS, RPCError, short, single_param, wire_type

ERROR_FORMS = ("map", "string", "array")


@dataclass
class ConnectionOptions:
    """What a connection chose with `options`."""

    errors: str = "map"  # "map" {code, message}, "string" "name: message", "array" [code, message]
    notifications: bool = True  # False: `stream: true` answers once, and no `error` notification is sent


def parse_options(params: list, current: ConnectionOptions) -> ConnectionOptions:
    """`options` takes [map] of ConnectionOptions' fields; those left out keep their value."""
    fields = single_param(params, "options", dict)
    for key, value in fields.items():
        if key == "errors" and value not in ERROR_FORMS:
            raise RPCError(
                INVALID_PARAMS, f"errors must be one of {', '.join(ERROR_FORMS)}, got {short(repr(value))}"
            )
        if key == "notifications" and not isinstance(value, bool):
            raise RPCError(INVALID_PARAMS, f"notifications must be a bool, got {wire_type(value)}")
        if key not in ("errors", "notifications"):
            raise RPCError(INVALID_PARAMS, f"unknown option {short(repr(key))}")
    return dataclasses.replace(current, **fields)
