"""MessagePack-RPC wire format: message kinds, error codes, limits, and the checks on `generate`'s params.

Spec: github.com/msgpack-rpc/msgpack-rpc/blob/master/spec.md. Messages are unframed msgpack arrays:
request [0, msgid, method, params], response [1, msgid, error, result], notification [2, method, params].
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import msgpack

from minisarathi.sampling_params import SamplingParams
from minisarathi.server.request_log import REQUEST_ID_RULE, valid_request_id
from minisarathi.validation import PRIORITY_RANGE

REQUEST, RESPONSE, NOTIFICATION = 0, 1, 2
CHUNK_NOTIFICATION = "generate.chunk"  # [2, "generate.chunk", [msgid, {"text", "token_ids"}]]
ERROR_NOTIFICATION = "error"  # [2, "error", [{"code", "message"}]]: an error no msgid can carry

# Error codes carried as {"code": int, "message": str} in a response's error slot (docs/protocol.md).
INVALID_MESSAGE = 1  # bytes that are not msgpack, a wrong message shape, an object over the size limit
UNKNOWN_METHOD = 2
INVALID_PARAMS = 3  # the message names the offending field
PROMPT_TOO_LONG = 4
UNAUTHORIZED = 5
OVERLOADED = 6  # queue full, too many requests in flight on the connection, or shutting down; retry_after_s
OVERLOADED_RETRY_S = 1.0  # overloaded's retry_after_s: a small constant, not an estimate (docs/protocol.md)
ABORTED = 7  # aborted by the client, or by the server on shutdown
INTERNAL = 8
RATE_LIMITED = 9  # over the key's quota; the error map also carries retry_after_s

ERROR_NAMES = {
    INVALID_MESSAGE: "invalid_message",
    UNKNOWN_METHOD: "unknown_method",
    INVALID_PARAMS: "invalid_params",
    PROMPT_TOO_LONG: "prompt_too_long",
    UNAUTHORIZED: "unauthorized",
    OVERLOADED: "overloaded",
    ABORTED: "aborted",
    INTERNAL: "internal",
    RATE_LIMITED: "rate_limited",
}


class RPCError(Exception):
    """An error that travels in a response: raised by server handlers, and by clients on an error response."""

    def __init__(self, code: int, message: str, retry_after_s: float | None = None):
        super().__init__(f"{ERROR_NAMES.get(code, code)}: {message}")
        self.code = code
        self.message = message
        # rate_limited: when the quota will admit the request
        self.retry_after_s = OVERLOADED_RETRY_S if code == OVERLOADED else retry_after_s

    @property
    def name(self) -> str:
        return ERROR_NAMES.get(self.code, "unknown")

    def to_wire(self, form: str = "map"):
        """The error slot's value in a connection's error form (ConnectionOptions.errors)."""
        if form == "string":
            return f"{self.name}: {self.message}"
        if form == "array":
            return [self.code, self.message]
        wire = {"code": self.code, "message": self.message}
        if self.retry_after_s is not None:
            wire["retry_after_s"] = self.retry_after_s
        return wire

    @classmethod
    def from_wire(cls, error) -> RPCError:
        if isinstance(error, dict) and isinstance(error.get("code"), int):
            retry = error.get("retry_after_s")
            return cls(
                error["code"],
                str(error.get("message", "")),
                retry if isinstance(retry, (int, float)) else None,
            )
        return cls(INTERNAL, repr(error))


MAY_BE_ZERO = {"drain_delay_s", "accept_rate_per_address"}  # ServerLimits fields whose 0 means "none"


@dataclass
class ServerLimits:
    """Every bound a client meets (docs/protocol.md, Limits): no legal request may cost others much."""

    max_message_bytes: int = 1 << 20  # one incoming msgpack object, and the unpacker's whole buffer
    max_prompt_tokens: int = 32768  # also bounded by the engine's max_model_len
    max_tokens: int = 4096  # the largest max_tokens a request may ask for
    # A stop string is searched for in every step's new text, a stop token id checked per token: unbounded
    # lists made one request slow down every other one (60k stop strings: a bystander's step 38x slower).
    max_stop_strings: int = 16
    max_stop_chars: int = 1024  # all of a request's stop strings together
    max_stop_token_ids: int = 64
    max_logit_bias: int = 1024  # entries of a request's logit_bias map
    max_tokenize_bytes: int = 256 << 10  # tokenize's text, in UTF-8 bytes
    max_detokenize_tokens: int = 65536  # detokenize's token ids
    # Also capped at the engine's max_num_seqs, so one connection cannot hold more than the engine runs.
    max_inflight_per_connection: int = 256
    max_pending_calls_per_connection: int = (
        16  # other calls not yet answered; past it the server stops reading
    )
    max_connections: int = 1024  # authenticated (or, without a key, all) open connections
    max_queued_requests: int = 1024  # unfinished requests server-wide (running + waiting)
    idle_timeout_s: float = 300.0  # a connection with nothing in flight and no bytes is closed
    auth_timeout_s: float | None = (
        None  # connect to a successful auth (trickled bytes do not extend it); None: idle_timeout_s
    )
    message_timeout_s: float | None = None  # first byte of a message to its last; None: idle_timeout_s
    max_unauthenticated_message_bytes: int = 4096  # one message before auth succeeds
    max_unauthenticated_connections: int = 256  # past it, the oldest unauthenticated one is closed
    max_unauthenticated_per_address: int = 32  # the same, per client IP address
    accept_rate_per_address: float = 0.0  # new connections per second per client address (gate.AcceptRate)
    max_write_buffer_bytes: int = (
        16 << 20
    )  # a client that stops reading its streams is disconnected past this
    unread_timeout_s: float = 60.0  # requests paused because their client stopped reading are then aborted
    # On SIGINT/SIGTERM, first serve as before this long with /ready answering 503, so that a balancer's
    # health checks take the replica out before it refuses anything (docs/deploy.md); then drain.
    drain_delay_s: float = 0.0
    shutdown_grace_s: float = 5.0  # on SIGINT/SIGTERM, in-flight requests get this long to finish
    template_timeout_s: float = 1.0  # one chat template render (its worker process is killed past it)
    max_n: int = 8  # choices per prompt (`n`)
    # prompts in one /v1/completions request; each prompt x n counts as a request against a key's quota
    max_prompts: int = 64

    def __post_init__(self):
        if self.auth_timeout_s is None:
            self.auth_timeout_s = self.idle_timeout_s
        if self.message_timeout_s is None:
            self.message_timeout_s = self.idle_timeout_s
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{f.name} must be a number, got {value!r}")
            may_be_zero = f.name in MAY_BE_ZERO
            if value < 0 or (value == 0 and not may_be_zero):
                raise ValueError(f"{f.name} must be {'>= 0' if may_be_zero else 'positive'}, got {value!r}")


UNPACKER_READ_SIZE = 16 << 10  # the buffer an unpacker starts with; it grows only for a message that needs it


def make_unpacker(max_message_bytes: int) -> msgpack.Unpacker:
    # Every length is capped by the message limit, so a hostile length prefix fails at its header (arrays,
    # maps) or when the buffer overflows (str, bin) instead of allocating what it claims. read_size: msgpack
    # reserves min(max_buffer_size, 1 MiB) up front by default; 1000 idle connections then held 1 GB.
    n = max_message_bytes
    return msgpack.Unpacker(
        raw=False,
        strict_map_key=False,
        max_buffer_size=2 * n,
        read_size=min(UNPACKER_READ_SIZE, 2 * n),
        max_str_len=n,
        max_bin_len=n,
        max_array_len=n,
        max_map_len=n // 2,
        max_ext_len=n,
    )


def pack(message) -> bytes:
    # Strict in what we send: text is always str, never bin (we send no bytes at all).
    return msgpack.packb(message, use_bin_type=True, default=_to_builtin)


def _to_builtin(value):
    # NumPy scalars (engine stats) have .item(); anything else is a bug worth a loud error.
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"cannot serialize {type(value).__name__}")


_WIRE_TYPES = {
    type(None): "nil",
    bool: "bool",
    int: "integer",
    float: "float",
    str: "string",
    bytes: "bin",
    list: "array",
    dict: "map",
}


def wire_type(value) -> str:
    """The msgpack type name of a decoded value, for error messages (a client never sees Python's names)."""
    return _WIRE_TYPES.get(type(value), "ext")


def as_text(value, name: str):
    """Liberal in what we accept: encoders from before msgpack's str/bin split (and some current ones, e.g.
    Go []byte) send text as bin. UTF-8 bin becomes str; anything else is returned unchanged."""
    if not isinstance(value, bytes):
        return value
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        raise RPCError(INVALID_PARAMS, f"{name} is bin that is not UTF-8 text") from None


def text_params(params: list) -> list:
    """as_text over every string a method takes: params items, map keys and values, list items and map keys
    inside those (generate's stop, logit_bias). Deeper values are never text, so the walk stops there."""

    def items(value, name):
        if isinstance(value, list) and _holds(value, bytes):
            return [as_text(item, name) for item in value]
        if isinstance(value, dict) and _holds(list(value), bytes):  # logit_bias' keys
            return {as_text(key, f"{name} key"): v for key, v in value.items()}
        return as_text(value, name)

    def param(value, i):
        if isinstance(value, dict):
            keys = [as_text(key, f"params[{i}] key") for key in value]
            return {key: items(v, str(key)) for key, v in zip(keys, value.values())}
        return items(value, f"params[{i}]")

    return [param(value, i) for i, value in enumerate(params)]


def as_int(value):
    """Integral floats become ints: some encoders send every number as a float."""
    return int(value) if type(value) is float and value.is_integer() else value


def token_id_list(values: list, name: str, vocab_size: int) -> list[int]:
    """values as token ids in [0, vocab_size), else RPCError naming `name`. Checked at C speed: item by item,
    a 64k-id detokenize held the event loop ~10 ms."""
    types = set(map(type, values))  # one pass over the types: each pass holds the GIL
    if float in types:
        values = [as_int(v) for v in values]
        types = set(map(type, values))
    if values and (types != {int} or min(values) < 0 or max(values) >= vocab_size):
        raise RPCError(INVALID_PARAMS, f"{name} must be integers in [0, {vocab_size})")
    return values


def _holds(values: list, kind: type) -> bool:
    # A 1 MiB message is ~300k token ids: checking the element types at C speed first keeps the per-item
    # Python conversion off the common path (about 50 ms of event-loop time for such a list).
    return kind in set(map(type, values))


_SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}
# integral floats (32.0, as some clients send numbers) become ints in these; the dataclass says which they are
_INT_FIELDS = {f.name for f in dataclasses.fields(SamplingParams) if f.type in ("int", "int | None")}
_INT_LIST_FIELDS = {"prompt_token_ids", "stop_token_ids"}
GENERATE_FIELDS = _SAMPLING_FIELDS | {"prompt", "prompt_token_ids", "stream", "priority", "request_id"}


@dataclass
class GenerateRequest:
    prompt: str | None
    prompt_token_ids: list[int] | None
    params: SamplingParams
    stream: bool
    priority: int | None  # lower runs first; None: the connection's default (MsgpackDoor._submit)
    request_id: str | None = None  # the client's id for the request (logs, result, abort), else one is made


def parse_generate(params: list, limits: ServerLimits) -> GenerateRequest:
    """`generate` takes params = [map], or positionally [prompt] or [prompt, map] (prompt: str or [int]);
    anything wrong raises RPCError(INVALID_PARAMS) naming the field."""
    fields = _generate_fields(params)
    for key in fields:
        if key not in GENERATE_FIELDS:
            raise RPCError(INVALID_PARAMS, f"unknown field {short(repr(key))}")
    # nil means "the default": Go encodes nil pointers and slices so, other clients their null/None.
    fields = {k: v for k, v in fields.items() if v is not None}
    for key in _INT_FIELDS & fields.keys():
        fields[key] = as_int(fields[key])
    for key in _INT_LIST_FIELDS & fields.keys():
        if isinstance(fields[key], list) and _holds(fields[key], float):
            fields[key] = [as_int(x) for x in fields[key]]
    prompt = fields.get("prompt")
    token_ids = fields.get("prompt_token_ids")
    if (prompt is None) == (token_ids is None):
        raise RPCError(INVALID_PARAMS, "exactly one of prompt, prompt_token_ids must be given")
    if prompt is not None and not isinstance(prompt, str):
        raise RPCError(INVALID_PARAMS, f"prompt must be a string, got {wire_type(prompt)}")
    if token_ids is not None and (
        not isinstance(token_ids, list)
        or not token_ids
        or set(map(type, token_ids)) != {int}
        or min(token_ids) < 0
    ):
        raise RPCError(INVALID_PARAMS, "prompt_token_ids must be a non-empty list of non-negative integers")
    stream = fields.get("stream", False)
    if not isinstance(stream, bool):
        raise RPCError(INVALID_PARAMS, f"stream must be a bool, got {short(repr(stream))}")
    priority = as_int(fields.get("priority"))
    if priority is not None and (
        type(priority) is not int or not PRIORITY_RANGE[0] <= priority <= PRIORITY_RANGE[1]
    ):
        raise RPCError(INVALID_PARAMS, f"priority must be a 32-bit integer, got {short(repr(priority))}")
    request_id = fields.get("request_id")
    if request_id is not None and not (isinstance(request_id, str) and valid_request_id(request_id)):
        raise RPCError(INVALID_PARAMS, f"request_id must be {REQUEST_ID_RULE}")
    try:
        check_list_bounds(fields, limits)
    except ListBoundError as e:
        raise RPCError(INVALID_PARAMS, str(e)) from None
    sampling = {k: v for k, v in fields.items() if k in _SAMPLING_FIELDS}
    try:
        sampling_params = SamplingParams(**sampling)
    except (ValueError, TypeError) as e:
        raise RPCError(INVALID_PARAMS, short(str(e))) from None
    if sampling_params.n > limits.max_n:
        raise RPCError(INVALID_PARAMS, f"n must be <= {limits.max_n}, got {sampling_params.n}")
    if sampling_params.max_tokens > limits.max_tokens:
        raise RPCError(
            INVALID_PARAMS, f"max_tokens must be <= {limits.max_tokens}, got {sampling_params.max_tokens}"
        )
    return GenerateRequest(prompt, token_ids, sampling_params, stream, priority, request_id)


class ListBoundError(ValueError):
    """A request field longer than ServerLimits allow; `field` names it (both doors report it)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def check_list_bounds(fields: dict, limits: ServerLimits) -> None:
    """The fields whose cost grows with their length, bounded before anything walks them (both doors)."""
    stop = fields.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if isinstance(stop, list):
        if len(stop) > limits.max_stop_strings:
            raise ListBoundError(
                "stop", f"stop must hold at most {limits.max_stop_strings} strings, got {len(stop)}"
            )
        total = sum(len(s) for s in stop if isinstance(s, str))
        if total > limits.max_stop_chars:
            raise ListBoundError(
                "stop", f"stop strings must total at most {limits.max_stop_chars} characters, got {total}"
            )
    for name, limit in (("stop_token_ids", limits.max_stop_token_ids), ("logit_bias", limits.max_logit_bias)):
        value = fields.get(name)
        if isinstance(value, (list, dict)) and len(value) > limit:
            raise ListBoundError(name, f"{name} must hold at most {limit} entries, got {len(value)}")


def _generate_fields(params: list) -> dict:
    usage = "params must be [map], [prompt] or [prompt, map] with prompt a string or a list of token ids"
    if len(params) == 1 and isinstance(params[0], dict):
        return params[0]
    if not 1 <= len(params) <= 2 or not isinstance(params[0], (str, list)):
        raise RPCError(INVALID_PARAMS, usage)
    options = params[1] if len(params) == 2 else {}
    if not isinstance(options, dict):
        raise RPCError(INVALID_PARAMS, usage)
    if "prompt" in options or "prompt_token_ids" in options:
        raise RPCError(INVALID_PARAMS, "prompt is given both positionally and in the map")
    return {**options, "prompt" if isinstance(params[0], str) else "prompt_token_ids": params[0]}


def short(text: str, limit: int = 200) -> str:
    # Error messages quote what the client sent; a 1 MiB field must not come back as a 1 MiB error.
    return text if len(text) <= limit else text[:limit] + "..."


def single_param(params: list, name: str, kind: type):
    """Methods with one argument accept it bare ([value]) or named ([{name: value}])."""
    if len(params) == 1 and isinstance(params[0], dict) and kind is not dict:
        if set(params[0]) != {name}:
            raise RPCError(INVALID_PARAMS, f"params must be [{name}] or [{{{name!r}: ...}}]")
        value = params[0][name]
    elif len(params) == 1:
        value = params[0]
    else:
        raise RPCError(INVALID_PARAMS, f"params must be [{name}]")
    value = as_int(value) if kind is int else value
    if isinstance(value, bool) or not isinstance(value, kind):
        raise RPCError(
            INVALID_PARAMS,
            f"{name} must be {'an integer' if kind is int else 'a ' + _WIRE_TYPES[kind]}, "
            f"got {wire_type(value)}",
        )
    return value
