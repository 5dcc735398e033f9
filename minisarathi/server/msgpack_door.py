"""The MessagePack-RPC door: the TCP and Unix-socket listeners of a Hub, the framing and methods of
docs/protocol.md, and each connection's state: its deadlines, auth, and backpressure on a client that leaves
its answers unread. Admission, quotas, the engine and drain are the hub's (hub.py).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import os
import socket
import time
from dataclasses import dataclass, field

import msgpack

from minisarathi.engine.step_log import step_time_summary
from minisarathi.server import embeddings
from minisarathi.server.auth import Key, Quota
from minisarathi.server.client_options import ConnectionOptions, parse_options
from minisarathi.server.gate import Arrival, bind, bind_unix, client_address
from minisarathi.server.hub import (
    UNREAD_HIGH_WATER,
    EngineRefused,
    Hub,
    ListenError,
    bound_kernel_buffer,
    internal_error,
)
from minisarathi.server.protocol import (
    ABORTED,
    CHUNK_NOTIFICATION,
    ERROR_NOTIFICATION,
    INVALID_MESSAGE,
    INVALID_PARAMS,
    NOTIFICATION,
    OVERLOADED,
    PROMPT_TOO_LONG,
    REQUEST,
    RESPONSE,
    UNAUTHORIZED,
    UNKNOWN_METHOD,
    UNPACKER_READ_SIZE,
    RPCError,
    ServerLimits,
    as_text,
    make_unpacker,
    pack,
    parse_generate,
    short,
    single_param,
    text_params,
    token_id_list,
)
from minisarathi.server.request_log import FinishedRequest

log = logging.getLogger("minisarathi.server")

_READ_SIZE = 1 << 16
_CLIENT_ID_PREFIX = "msgpack:"  # engine ids of requests whose client named them
_UNAUTHENTICATED_READ_SIZE = 1 << 12
_CLOSE_LINGER_S = 5.0
_THROUGHPUT_WINDOW_S = 10.0
_MAX_AUTH_FAILURES_PER_CONNECTION = 8
# stats' steps_since summarizes at most this many steps: the summary holds the loop (and the GIL) while it
# is made, like a short prompt's encode.
STEP_SUMMARY_MAX_STEPS = 1024


def _public_id(request_id: str) -> str:
    """The id the client gave (or the generated req-N), without the engine's door prefix."""
    return request_id.removeprefix(_CLIENT_ID_PREFIX)


class _Connection:
    def __init__(
        self,
        conn_id: int,
        writer: asyncio.StreamWriter,
        limits: ServerLimits,
        authenticated: bool,
        peer: str = "unix",
        on_stall=None,
    ):
        self.id = conn_id
        self.writer = writer
        self.peer = peer  # the client's "host:port", for the request log
        self.address = client_address(peer.rpartition(":")[0] or peer)  # for per-address rules ("unix")
        self.limits = limits
        self.authenticated = authenticated
        self.opened = time.monotonic()  # the auth deadline runs from it (reset when an auth is revoked)
        self.key: Key | None = None  # the key it authenticated with (None without keys)
        self.inflight: dict[int, _Pending] = {}  # msgid -> its generate
        self.default_priority = 0  # of its requests that give none: its API key's
        self.pending_calls = 0  # other calls being answered (tokenize, stats, ...)
        self.call_done = asyncio.Event()  # set when pending_calls drops
        # its calls being answered and prompts being tokenized: cancelled when it closes, so its queued
        # tokenizer work goes with it
        self.tasks: set[asyncio.Task] = set()
        self.auth_failures = 0
        self.auth_failed = False  # its last auth failed: its next message waits for its address's turn
        self.stalled = False  # its output waits unread: its requests are paused
        self.options = ConnectionOptions()  # its error form, notifications or not (the `options` call)
        self._on_stall = on_stall  # called once each time the output backs up
        self._held: list[bytes] | None = None  # while corked: the packed messages sent, in order
        self.output_ended = False  # end_output() was called: nothing more is sent
        self.closed = False

    def send(self, message):
        if self.closed or self.output_ended:
            return
        if self._held is not None:
            self._held.append(pack(message))
            return
        self._write(pack(message))

    def cork(self) -> bool:
        """Hold what is sent until uncork(), which writes it in one piece; True if it was not corked yet. The
        door corks a connection while it delivers one engine step's outputs: the chunks of many streams then
        cost one socket write, not one each (each write is a syscall that lets the engine thread take the
        GIL, then waits to get it back)."""
        if self._held is not None:
            return False
        self._held = []
        return True

    def uncork(self):
        held, self._held = self._held, None
        if held and not self.closed:
            self._write(b"".join(held))

    def _write(self, data: bytes):
        self.writer.write(data)
        buffered = self.buffered()
        if buffered > self.limits.max_write_buffer_bytes:
            log.warning("conn=%d is not reading its responses; disconnecting", self.id)
            self.close()
        elif buffered > UNREAD_HIGH_WATER and not self.stalled and self._on_stall is not None:
            self.stalled = True
            self._on_stall(self)

    def buffered(self) -> int:
        """Output written but not yet taken by the kernel."""
        try:
            return self.writer.transport.get_write_buffer_size()
        except AttributeError:  # a closed TLS transport (CPython's sslproto drops its protocol on close)
            return 0

    def respond(self, msgid: int, error: RPCError | None, result=None):
        self.send([RESPONSE, msgid, None if error is None else error.to_wire(self.options.errors), result])

    def protocol_error(self, msgid: int | None, error: RPCError):
        """A response when the msgid is known; otherwise a notification, since a response's msgid must be a
        uint32 and a made-up one could match a real request."""
        if msgid is None:
            if self.options.notifications:
                self.send([NOTIFICATION, ERROR_NOTIFICATION, [error.to_wire(self.options.errors)]])
        else:
            self.respond(msgid, error)

    def end_output(self) -> bool:
        """Send the end of the stream after what was written (the socket stays open for reading); False where
        the transport cannot (TLS)."""
        if self.closed or not self.writer.can_write_eof():
            return False
        self.uncork()
        if self.closed:
            return False
        try:
            self.writer.write_eof()
        except OSError:  # the client already went (ENOTCONN): nothing to linger for
            self.close()
            return False
        self.output_ended = True
        return True

    def close(self, flush: bool = False):
        """Drop the socket; with flush, the client first gets what was written, if it takes it within
        _CLOSE_LINGER_S (a client that reads nothing would otherwise hold the socket and its buffer)."""
        if self.closed:
            return
        if flush:
            self.uncork()  # what was held goes out first
            if self.closed:  # (the client was not reading it: dropped)
                return
        self._held = None
        self.closed = True
        if not flush:
            self.writer.transport.abort()
            return
        self.writer.close()
        if self.buffered():
            asyncio.get_running_loop().call_later(_CLOSE_LINGER_S, self.writer.transport.abort)


@dataclass
class _Pending:
    """A generate request the door holds until its final response."""

    request_id: str
    conn: _Connection
    msgid: int
    stream: bool
    want_logprobs: bool
    prompt: str | list[int]
    received: float  # time.monotonic() when the request was read
    prompt_tokens: int = 0  # known once tokenized
    first_token_time: float | None = None
    sent: list[tuple[int, int]] = field(default_factory=list)  # per choice: (characters, token ids) streamed
    quota: Quota | None = None  # the key's quota it was charged to, how many tokens and requests (n)
    charged_tokens: int = 0
    charged_requests: int = 1


class _BadMessage(Exception):
    """A message of the wrong shape: answered (when its msgid is known), then the connection closes."""

    def __init__(self, msgid, message: str):
        super().__init__(message)
        self.msgid = msgid


class MsgpackDoor:
    """A hub's msgpack-RPC door: listens on TCP (host None: not) and on a Unix socket (if given)."""

    def __init__(
        self, hub: Hub, host: str | None = "127.0.0.1", port: int = 7000, unix_socket: str | None = None
    ):
        self.hub = hub
        self.host, self.port, self.unix_socket = host, port, unix_socket
        self.limits = hub.limits
        self._socks: list[socket.socket] = []  # listening
        self._connections: set[_Connection] = set()  # this door's (the hub's set has every door's)
        self._unix_path: str | None = None  # the socket file this door made
        self._request_ids = itertools.count()
        self._conn_ids = itertools.count()
        self._delivered: collections.deque = collections.deque()  # (time, tokens) in the throughput window
        self._tasks: set[asyncio.Task] = set()  # running stall watchers (the loop keeps weak refs only)
        self._max_inflight = min(self.limits.max_inflight_per_connection, hub.engine.config.max_num_seqs)

    # ---------------------------------------------------------------- lifecycle (called by the hub)

    async def start(self) -> list[str]:
        """Listen; returns the addresses ("HOST:PORT", "unix:PATH")."""
        # The listen backlog holds a burst of connections as large as the server takes (asyncio's default,
        # 100, is too short for a burst the loop is busy accepting).
        backlog = min(self.limits.max_connections, socket.SOMAXCONN)
        addresses = []
        if self.host is not None:
            try:
                socks = bind(self.host, self.port, backlog)
            except OSError as e:
                raise ListenError("tcp", e) from None
            self._socks += socks
            addresses += [f"{s.getsockname()[0]}:{s.getsockname()[1]}" for s in socks]
        if self.unix_socket is not None:
            try:
                self._socks.append(bind_unix(self.unix_socket, backlog))
            except OSError as e:
                raise ListenError("unix", e) from None
            self._unix_path = self.unix_socket
            addresses.append(f"unix:{self.unix_socket}")
        for sock in self._socks:
            self.hub.listen(sock, self._protocol)
        return addresses

    def _protocol(self, arrival: Arrival) -> asyncio.Protocol:
        serve = lambda reader, writer: self._serve_connection(reader, writer, arrival)  # noqa: E731
        return asyncio.StreamReaderProtocol(asyncio.StreamReader(limit=_READ_SIZE), serve)

    async def stop_accepting(self):
        """The listeners close; a connection with nothing in flight closes at once, each other one as soon as
        its last request is answered, so a client's next request reconnects instead of meeting a draining
        server."""
        for sock in self._socks:
            self.hub.stop_listening(sock)
        for conn in list(self._connections):
            if not conn.inflight:
                conn.close(flush=True)

    async def stop(self):
        for conn in list(self._connections):
            conn.close(flush=True)
        for sock in self._socks:
            self.hub.stop_listening(sock)
        if self._unix_path is not None and os.path.exists(self._unix_path):
            os.unlink(self._unix_path)

    # ---------------------------------------------------------------- connections

    async def _serve_connection(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, arrival: Arrival
    ):
        conn = _Connection(
            next(self._conn_ids),
            writer,
            self.limits,
            authenticated=self.hub.keys is None,
            peer=arrival.peer,  # a trusted proxy's client, as its header named it
            on_stall=self._on_stall,
        )
        writer.transport.set_write_buffer_limits(high=UNREAD_HIGH_WATER)
        if self.hub.shutting_down:  # accepted just before the listener closed: the client will go elsewhere
            self.hub.pool.disconnect(arrival)
            conn.close()
            return
        bound_kernel_buffer(writer.get_extra_info("socket"))
        refused = self.hub.pool.hand_over(arrival, conn)
        if refused is not None:
            log.warning("conn=%d refused: %s", conn.id, refused)
            conn.protocol_error(None, RPCError(OVERLOADED, refused))
            conn.close(flush=True)
            return
        log.debug("conn=%d opened from %s", conn.id, conn.peer)
        self._connections.add(conn)
        reading = _Reader(conn, self.limits)
        try:
            if not conn.authenticated and not await self._auth_turn(conn):
                return
            while not conn.closed:
                try:
                    # asyncio.timeout, not wait_for: the read runs in this task, not in one made per read,
                    # so a message costs the loop two iterations (each a GIL hand-over with the engine
                    # thread) less
                    async with asyncio.timeout(reading.timeout()):
                        data = await reader.read(reading.read_size)
                except TimeoutError:
                    why = reading.expired()
                    if why is None:
                        continue
                    log.info("conn=%d closed: %s", conn.id, why)
                    break
                if not data:
                    break
                reading.feed(data)
                while not conn.closed and (message := reading.next_message()) is not _NO_MESSAGE:
                    was_authenticated = conn.authenticated
                    self._handle_message(conn, message)
                    if conn.authenticated and not was_authenticated:  # the full message size from now on
                        reading.resize()
                    if not await self._throttle_reading(conn):
                        break
                reading.done_with_data()
        except _BadMessage as e:
            log.info("conn=%d bad message: %s", conn.id, e)
            conn.protocol_error(e.msgid, RPCError(INVALID_MESSAGE, str(e)))
            await self._linger(conn, reader)
        except (ConnectionError, OSError):
            pass
        finally:
            self._close_connection(conn)

    async def _linger(self, conn: _Connection, reader: asyncio.StreamReader):
        """Before a connection closes on a bad message: the error, then the end of the stream, and what the
        client still sends read and dropped, up to 2 x max_message_bytes for _CLOSE_LINGER_S at most. A socket
        closed with unread input is reset: a client still sending its (say oversized) message would get the
        reset, not the error, and one reading would see a reset after the error instead of the end of the
        stream."""
        if not conn.end_output():
            return
        self._drop_requests(conn)  # their outputs could not be sent any more
        budget = 2 * self.limits.max_message_bytes
        try:
            async with asyncio.timeout(_CLOSE_LINGER_S):
                while budget > 0 and (data := await reader.read(min(budget, _READ_SIZE))):
                    budget -= len(data)
        except (TimeoutError, ConnectionError, OSError):
            pass

    async def _throttle_reading(self, conn: _Connection) -> bool:
        """Pause reading a connection: after a failed auth (its backoff), while its answers wait unread, and
        while it has max_pending_calls_per_connection calls unanswered. False when the connection is done."""
        if conn.auth_failed:
            conn.auth_failed = False
            if not await self._auth_turn(conn):
                return False
        while conn.pending_calls >= self.limits.max_pending_calls_per_connection and not conn.closed:
            conn.call_done.clear()
            await conn.call_done.wait()
        return await self._wait_for_reader(conn)

    async def _auth_turn(self, conn: _Connection) -> bool:
        """Before an unauthenticated connection's next bytes are read: its address's turn at the backoff."""
        if not await self.hub.auth_turn(conn.address):
            conn.protocol_error(None, RPCError(UNAUTHORIZED, "too many failed auths from this address"))
            conn.close(flush=True)
        return not conn.closed

    async def _wait_for_reader(self, conn: _Connection) -> bool:
        """Backpressure: take no more requests from a client that leaves its responses unread, so a
        pipelining client holds about UNREAD_HIGH_WATER bytes here, not all it asked for. False when the
        connection is done."""
        if conn.closed or conn.buffered() <= UNREAD_HIGH_WATER:
            return not conn.closed
        try:
            await asyncio.wait_for(conn.writer.drain(), self.limits.unread_timeout_s)
        except asyncio.TimeoutError:
            log.warning(
                "conn=%d left its responses unread for %.0fs; closing", conn.id, self.limits.unread_timeout_s
            )
            conn.close()
        except (ConnectionError, OSError):
            conn.close()
        return not conn.closed

    def _on_stall(self, conn: _Connection):
        """The client stopped reading: pause its requests (their batch slots go to others), resume them when
        it reads again, abort them (closing the connection) if it does not within unread_timeout_s."""
        self.hub.pause([p.request_id for p in conn.inflight.values()], True)
        task = asyncio.ensure_future(self._await_unstall(conn))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _await_unstall(self, conn: _Connection):
        try:
            await asyncio.wait_for(conn.writer.drain(), self.limits.unread_timeout_s)
        except asyncio.TimeoutError:
            log.warning(
                "conn=%d left %d requests unread for %.0fs; aborting them",
                conn.id,
                len(conn.inflight),
                self.limits.unread_timeout_s,
            )
            self.hub.counters["unread_aborts"] += len(conn.inflight)
            conn.close()
            return
        except (ConnectionError, OSError):
            conn.close()
            return
        conn.stalled = False
        if not conn.closed:
            self.hub.pause([p.request_id for p in conn.inflight.values()], False)

    def _close_connection(self, conn: _Connection):
        conn.close(flush=True)  # an error about a bad message, say, still reaches the client
        self.hub.pool.disconnect(conn)
        self._connections.discard(conn)
        self._drop_requests(conn)
        log.debug("conn=%d closed", conn.id)

    def _drop_requests(self, conn: _Connection):
        """Cancel the connection's calls being answered and abort its requests."""
        conn.call_done.set()
        for task in list(conn.tasks):  # its tokenize calls still queued for the tokenizer thread, say
            task.cancel()
        for pending in list(conn.inflight.values()):
            log.info("%s aborted: client disconnected", pending.request_id)
            self._report_aborted(pending)
            self._cancel(pending)
            self._end(pending)

    def _handle_message(self, conn: _Connection, message):
        if not isinstance(message, list) or not message or type(message[0]) is not int:
            raise _BadMessage(None, "a message must be an array [type, ...]")
        kind = message[0]
        if kind == NOTIFICATION and len(message) == 3:
            self._handle_notification(conn, message[1], message[2])
            return
        msgid = message[1] if kind == REQUEST and len(message) >= 2 and _is_msgid(message[1]) else None
        if kind != REQUEST or len(message) != 4 or msgid is None:
            raise _BadMessage(msgid, "a request must be [0, msgid (uint32), method, params]")
        _, msgid, method, params = message
        method = _method_name(method, msgid)
        try:
            # Auth first: a client without the key learns nothing about methods or params.
            if not conn.authenticated and method not in ("auth", "options"):
                raise RPCError(UNAUTHORIZED, "call auth with the API key first")
            handler = self._handlers.get(method)
            if handler is None:
                raise RPCError(UNKNOWN_METHOD, f"unknown method {short(repr(method))}")
            result = handler(self, conn, msgid, _params_array(params))
        except Exception as e:
            self._respond_error(conn, msgid, method, e)
        else:
            if asyncio.iscoroutine(result):
                conn.pending_calls += 1
                self._start_task(conn, self._respond_later(conn, msgid, method, result))
            elif method != "generate":  # generate answers when the engine finishes it
                conn.respond(msgid, None, result)

    def _handle_notification(self, conn: _Connection, method, params):
        """The spec's notifications want no response. `abort` and `auth` take effect (fire and forget);
        every other method is ignored, since its only effect would be a result no one receives."""
        try:
            method = _method_name(method, None)
            if method not in ("abort", "auth") or (not conn.authenticated and method != "auth"):
                log.debug("conn=%d ignored notification %s", conn.id, short(method))
                return
            self._handlers[method](self, conn, None, _params_array(params))
        except RPCError as e:
            if e.code != UNAUTHORIZED:
                log.info("conn=%d notification %s failed: %s", conn.id, method, e)

    @staticmethod
    def _respond_error(conn: _Connection, msgid: int, method: str, error: Exception):
        """Called in the except clause: an RPCError as it is, any other exception logged and answered as an
        internal error."""
        if not isinstance(error, RPCError):
            log.exception("conn=%d msgid=%s %s failed", conn.id, msgid, method)
            error = internal_error()
        elif error.code != UNAUTHORIZED:  # those are counted and summarized by the throttle
            log.info("conn=%d msgid=%s %s failed: %s", conn.id, msgid, short(method), error)
        conn.respond(msgid, error)

    def _start_task(self, conn: _Connection, coroutine):
        task = asyncio.ensure_future(coroutine)
        conn.tasks.add(task)
        task.add_done_callback(conn.tasks.discard)

    async def _respond_later(self, conn, msgid, method, coroutine):
        try:
            result = await coroutine
        except Exception as e:
            self._respond_error(conn, msgid, method, e)
        else:
            conn.respond(msgid, None, result)
        finally:
            conn.pending_calls -= 1
            conn.call_done.set()

    # ---------------------------------------------------------------- methods

    def _generate(self, conn: _Connection, msgid: int, params: list):
        hub = self.hub
        if hub.shutting_down and not conn.inflight:
            conn.close(flush=True)  # not taken: the closed connection sends the client elsewhere
            return None
        request = parse_generate(params, self.limits)
        request.stream = request.stream and conn.options.notifications
        n, max_tokens = request.params.n, request.params.max_tokens
        # what the key's quota and the queue would refuse, before any tokenizing (a text: 1 token at least)
        hub.precheck(conn.key, max_tokens, len(request.prompt_token_ids or [0]) + n * max_tokens, n, 1)
        if msgid in conn.inflight:
            raise RPCError(INVALID_PARAMS, f"msgid {msgid} is already in flight on this connection")
        if len(conn.inflight) >= self._max_inflight:
            raise RPCError(
                OVERLOADED, f"more than {self._max_inflight} requests in flight on this connection"
            )
        if request.prompt is not None:
            hub.check_prompt_bytes(request.prompt, "prompt")
        if request.request_id is None:
            request_id = f"req-{next(self._request_ids)}"
        else:  # the door's prefix keeps the client's ids apart from the generated ones and the HTTP door's
            request_id = f"{_CLIENT_ID_PREFIX}{request.request_id}"
            if hub.in_use(request_id):
                raise RPCError(INVALID_PARAMS, f"request_id {request.request_id!r} is already in use")
        pending = _Pending(
            request_id,
            conn,
            msgid,
            request.stream,
            request.params.logprobs is not None,
            request.prompt if request.prompt is not None else request.prompt_token_ids,
            time.monotonic(),
        )
        hub.open(request_id, lambda output: self._on_output(pending, output))
        conn.inflight[msgid] = pending
        token_ids = request.prompt_token_ids or hub.encode(request.prompt)
        if isinstance(token_ids, list):
            self._submit(pending, request, token_ids)
        else:  # a big prompt, on the tokenizer thread
            self._start_task(conn, self._tokenize_then_submit(pending, request, token_ids))

    async def _tokenize_then_submit(self, pending: _Pending, request, encoding):
        token_ids = await encoding
        if pending.conn.inflight.get(pending.msgid) is pending:  # not aborted meanwhile
            self._submit(pending, request, token_ids)

    def _submit(self, pending: _Pending, request, token_ids: list[int]):
        """Checks that need the token ids, the key's quota, then the engine."""
        vocab_size = self.hub.engine.tokenizer.vocab_size
        try:
            if request.prompt is None and max(token_ids) >= vocab_size:
                raise RPCError(INVALID_PARAMS, f"prompt_token_ids must be < vocab_size ({vocab_size})")
            if len(token_ids) > self.hub.max_prompt_tokens:
                raise RPCError(
                    PROMPT_TOO_LONG,
                    f"prompt has {len(token_ids)} tokens; the limit is {self.hub.max_prompt_tokens}",
                )
            n = request.params.n
            charge = len(token_ids) + n * request.params.max_tokens
            pending.quota = self.hub.admit(pending.conn.key, request.params.max_tokens, charge, n)
            pending.charged_tokens, pending.charged_requests = charge, n
        except RPCError as e:
            log.info("%s rejected: %s", pending.request_id, e)
            self.hub.cancel(pending.request_id)
            self._fail(pending, e)
            return
        conn = pending.conn
        pending.prompt_tokens = len(token_ids)
        priority = conn.default_priority if request.priority is None else request.priority
        log.info(
            "%s conn=%d msgid=%d prompt_tokens=%d max_tokens=%d stream=%s priority=%d",
            pending.request_id,
            conn.id,
            pending.msgid,
            len(token_ids),
            request.params.max_tokens,
            request.stream,
            priority,
        )
        # a client that is not reading: its request starts paused
        self.hub.submit(
            pending.request_id,
            token_ids,
            request.params,
            pending.received,
            priority,
            request.stream,
            paused=conn.stalled,
        )

    def _abort(self, conn: _Connection, msgid: int, params: list) -> bool:
        """params [msgid] (of the generate call), or [{"request_id": id}] (the id given to generate)."""
        if len(params) == 1 and isinstance(params[0], dict) and "request_id" in params[0]:
            request_id = _CLIENT_ID_PREFIX + single_param(params, "request_id", str)
            pending = next((p for p in conn.inflight.values() if p.request_id == request_id), None)
        else:
            pending = conn.inflight.get(single_param(params, "msgid", int))
        if pending is None:
            return False  # unknown, or already finished
        log.info("%s aborted by the client", pending.request_id)
        self._report_aborted(pending)
        self._cancel(pending)
        self._fail(pending, RPCError(ABORTED, "aborted by the client"))
        return True

    def _tokenize(self, conn, msgid, params):
        text = single_param(params, "text", str)
        if len(text) > self.limits.max_tokenize_bytes // 4:  # a character is at most 4 bytes
            num_bytes = len(text.encode("utf-8", "surrogatepass"))
            if num_bytes > self.limits.max_tokenize_bytes:
                raise RPCError(
                    INVALID_PARAMS,
                    f"text must be at most {self.limits.max_tokenize_bytes} bytes, got {num_bytes}",
                )
        return self.hub.encode(text)

    def _detokenize(self, conn, msgid, params):
        token_ids = single_param(params, "token_ids", list)
        if len(token_ids) > self.limits.max_detokenize_tokens:
            raise RPCError(
                INVALID_PARAMS,
                f"token_ids must hold at most {self.limits.max_detokenize_tokens} ids, got {len(token_ids)}",
            )
        return self.hub.decode(token_id_list(token_ids, "token_ids", self.hub.engine.tokenizer.vocab_size))

    def _model_info(self, conn, msgid, params) -> dict:
        engine = self.hub.engine
        config = engine.config
        return {
            "model": self.hub.model_name,
            "vocab_size": engine.tokenizer.vocab_size,
            "max_model_len": engine.max_model_len,
            "eos_token_ids": list(engine.tokenizer.eos_token_ids),
            "scheduler": config.scheduler,
            "chunk_size": config.chunk_size,
            "block_size": config.block_size,
            "max_num_seqs": config.max_num_seqs,
            "device": config.device,
            "enable_prefix_caching": config.enable_prefix_caching,
            "tensor_parallel_size": config.tensor_parallel_size,
            "weight_format": engine.model.weight_format,
            "weight_bytes": engine.model.weight_bytes,
            "max_prompt_tokens": self.hub.max_prompt_tokens,
            "max_tokens": self.limits.max_tokens,
        }

    def _health(self, conn, msgid, params) -> dict:
        """ "failed" (with the error) once the model cannot run any more (its tensor-parallel ranks died), so
        a load balancer's check takes the replica out."""
        uptime = time.monotonic() - self.hub.started
        if self.hub.engine.model_failure is not None:
            return {"status": "failed", "error": str(self.hub.engine.model_failure), "uptime_s": uptime}
        return {"status": "shutting_down" if self.hub.shutting_down else "ok", "uptime_s": uptime}

    async def _stats(self, conn, msgid, params) -> dict:
        """params [] or [{"steps_since": N}]: the latter adds `step_times`, the summary of the steps from
        step N (stats' `steps` counts them) on, at most the latest STEP_SUMMARY_MAX_STEPS."""
        since = None if not params else single_param(params, "steps_since", int)
        if since is not None and since < 0:
            raise RPCError(INVALID_PARAMS, f"steps_since must be >= 0, got {since}")
        engine = self.hub.engine

        def read():  # on the engine thread: the records only (a list of references), summarized here
            steps = engine.step_records
            first = None if since is None else max(since, len(steps) - STEP_SUMMARY_MAX_STEPS)
            return engine.stats(), None if first is None else steps[first:]

        engine_stats, records = await self.hub.engine_call(read)
        if records is not None:
            engine_stats["step_times"] = step_time_summary(records)
        now = time.monotonic()
        self._trim_throughput_window(now)
        window = min(_THROUGHPUT_WINDOW_S, now - self.hub.started)
        connections = self._connections
        return {
            **engine_stats,
            **self.hub.security_stats(),
            "connections": len(self.hub.pool.connections),
            "pending_requests": self.hub.num_requests,
            "pending_calls": sum(c.pending_calls for c in connections),
            "write_buffer_bytes": sum(c.buffered() for c in connections if not c.closed),
            "throughput_tokens_per_s": sum(n for _, n in self._delivered) / max(window, 1e-9),
            "uptime_s": now - self.hub.started,
        }

    def _auth(self, conn, msgid, params) -> bool:
        secret = single_param(params, "api_key", str)
        if self.hub.keys is None:
            return True
        accepted, key = self.hub.authenticate(secret, conn.address)
        if not accepted:
            self.hub.pool.revoke(conn)
            conn.auth_failures += 1
            conn.auth_failed = True
            if conn.auth_failures >= _MAX_AUTH_FAILURES_PER_CONNECTION:
                conn.close(flush=True)
            raise RPCError(UNAUTHORIZED, "wrong API key")
        if not self.hub.pool.grant(conn, key):
            raise RPCError(OVERLOADED, f"more than {self.limits.max_connections} connections")
        conn.default_priority = key.priority
        return True

    def _options(self, conn, msgid, params) -> dict:
        """Before auth too, so that auth's own error comes in the form the client reads."""
        conn.options = parse_options(params, conn.options)
        return dataclasses.asdict(conn.options)

    _handlers = {
        "options": _options,
        "generate": _generate,
        "embed": embeddings.msgpack_embed,  # answered by its coroutine (server/embeddings.py)
        "abort": _abort,
        "tokenize": _tokenize,
        "detokenize": _detokenize,
        "model_info": _model_info,
        "health": _health,
        "stats": _stats,
        "auth": _auth,
    }

    # ---------------------------------------------------------------- engine outputs (on the loop)

    def _on_output(self, pending: _Pending, output):
        """The hub's delivery of one request's output (or its error)."""
        if isinstance(output, RPCError):
            self._fail(pending, output)
            return
        # Each connection's messages of this engine step go out in one write, on the loop's next turn.
        if pending.conn.cork():
            asyncio.get_running_loop().call_soon(pending.conn.uncork)
        now = time.monotonic()
        for completion in output.outputs:  # n > 1: every choice's chunks carry its index
            if completion.index == len(pending.sent):
                pending.sent.append((0, 0))
            sent_chars, sent_tokens = pending.sent[completion.index]
            piece = completion.text[sent_chars:]
            new_ids = list(completion.token_ids[sent_tokens:])
            if new_ids:
                if pending.first_token_time is None:  # unstreamed: reported once, at its end
                    pending.first_token_time = now if pending.stream else output.metrics.first_token_time
                self._delivered.append((now, len(new_ids)))
                self._trim_throughput_window(now)
            if pending.stream and (piece or new_ids):
                chunk = {"text": piece, "token_ids": new_ids}
                if len(output.outputs) > 1:
                    chunk["index"] = completion.index
                pending.conn.send([NOTIFICATION, CHUNK_NOTIFICATION, [pending.msgid, chunk]])
            pending.sent[completion.index] = (len(completion.text), len(completion.token_ids))
        if output.finished:
            self._finish(pending, output, now)

    def _finish(self, pending: _Pending, output, now: float):
        choices = [self._choice_result(pending, completion) for completion in output.outputs]
        completion_tokens = sum(len(c.token_ids) for c in output.outputs)
        # choice 0 at the top level; with n > 1 every choice (0 included) also in `choices`
        result = {
            "request_id": _public_id(pending.request_id),
            **choices[0],
            "prompt_tokens": pending.prompt_tokens,
            "completion_tokens": completion_tokens,
            "cached_tokens": output.num_cached_tokens,
            "ttft_s": (
                None if pending.first_token_time is None else pending.first_token_time - pending.received
            ),
            "e2e_s": now - pending.received,
        }
        if len(choices) > 1:
            result["choices"] = [{"index": i, **choice} for i, choice in enumerate(choices)]
        self.hub.report_finished(
            FinishedRequest(
                _public_id(pending.request_id),
                "msgpack",
                pending.conn.peer,
                pending.prompt,
                pending.prompt_tokens,
                output.num_cached_tokens,
                completion_tokens,
                output.outputs[0].finish_reason,
                output.metrics,
            )
        )
        if self._end(pending):
            pending.conn.respond(pending.msgid, None, result)
            self._close_if_drained(pending.conn)

    @staticmethod
    def _choice_result(pending: _Pending, completion) -> dict:
        result = {
            "text": completion.text,
            "token_ids": list(completion.token_ids),
            "finish_reason": completion.finish_reason,
            "stop_reason": completion.stop_reason,
        }
        if pending.want_logprobs:
            result["logprobs"] = [
                [
                    {
                        "token_id": token_id,
                        "logprob": lp.logprob,
                        "rank": lp.rank,
                        "decoded_token": lp.decoded_token,
                    }
                    for token_id, lp in position.items()
                ]
                for position in completion.logprobs or []
            ]
        return result

    def _fail(self, pending: _Pending, error: RPCError):
        if self._end(pending, refused=isinstance(error, EngineRefused)):
            pending.conn.respond(pending.msgid, error)
            self._close_if_drained(pending.conn)

    def _end(self, pending: _Pending, refused: bool = False) -> bool:
        """The request leaves its connection, and its quota gets back what it did not use (everything, the
        request units too, if the engine refused it); False if it had left."""
        if pending.conn.inflight.get(pending.msgid) is not pending:
            return False
        del pending.conn.inflight[pending.msgid]
        if pending.quota is not None:
            used = 0 if refused else pending.prompt_tokens, 0 if refused else sum(t for _, t in pending.sent)
            refunded = pending.charged_requests if refused else 0
            pending.quota.finish(pending.charged_tokens, *used, pending.charged_requests, refunded)
        return True

    def _cancel(self, pending: _Pending) -> None:
        """Abort the request in the engine; its quota (taken from it here) pays for every token the engine
        generated, delivered or not (an unstreamed request has delivered none)."""
        quota, pending.quota = pending.quota, None
        if quota is None:
            self.hub.cancel(pending.request_id)
            return
        delivered = sum(t for _, t in pending.sent)

        def aborted(generated: int):
            completion = max(generated, delivered)
            quota.finish(pending.charged_tokens, pending.prompt_tokens, completion, pending.charged_requests)

        self.hub.cancel(pending.request_id, aborted)

    def _close_if_drained(self, conn: _Connection):
        if self.hub.shutting_down and not conn.inflight:
            conn.close(flush=True)

    def _report_aborted(self, pending: _Pending) -> None:
        self.hub.report_finished(
            FinishedRequest(
                _public_id(pending.request_id),
                "msgpack",
                pending.conn.peer,
                pending.prompt,
                pending.prompt_tokens,
                0,
                sum(t for _, t in pending.sent),
                "abort",
                None,
            )
        )

    def _trim_throughput_window(self, now: float):
        while self._delivered and self._delivered[0][0] < now - _THROUGHPUT_WINDOW_S:
            self._delivered.popleft()


def _is_msgid(value) -> bool:
    return type(value) is int and 0 <= value < 2**32


_NO_MESSAGE = object()


class _Reader:
    """One connection's incoming bytes: the unpacker (small before auth, sized to use after), its deadlines.

    Deadlines: an unauthenticated connection must authenticate within auth_timeout_s of connecting, and a
    message must arrive whole within message_timeout_s of its first byte; bytes trickled in do not extend
    either. A connection with nothing in flight that sends nothing for idle_timeout_s is closed.
    """

    def __init__(self, conn: _Connection, limits: ServerLimits):
        self._conn = conn
        self._limits = limits
        self._message_started: float | None = None  # when the unfinished message's first byte came
        self._message_at = 0  # unpacker offset where that message starts
        self._unpacker: msgpack.Unpacker | None = None
        self.resize()

    def resize(self):
        """A fresh unpacker for the connection's state (called with no bytes pending, or on auth), keeping
        the bytes not yet unpacked: before auth they are at most 2 x max_unauthenticated_message_bytes,
        which _tail keeps (msgpack cannot hand back a half-read object)."""
        rest = b""
        if self._unpacker is not None and self._fed > self._consumed:
            rest = self._tail[len(self._tail) - (self._fed - self._consumed) :]
        limit = (
            self._limits.max_message_bytes
            if self._conn.authenticated
            else self._limits.max_unauthenticated_message_bytes
        )
        self.read_size = _READ_SIZE if self._conn.authenticated else _UNAUTHENTICATED_READ_SIZE
        self._unpacker = make_unpacker(limit)
        self._fed = 0
        self._consumed = 0  # bytes of whole messages unpacked (msgpack's tell() also counts a partial one)
        self._message_at = 0
        self._grown = False
        self._tail = b""
        if rest:
            self.feed(rest)

    def feed(self, data: bytes):
        try:
            self._unpacker.feed(data)
        except msgpack.BufferFull:
            raise _BadMessage(None, "message exceeds the size limit") from None
        self._fed += len(data)
        if not self._conn.authenticated:
            self._tail = (self._tail + data)[-2 * self._limits.max_unauthenticated_message_bytes :]
        if self._fed - self._consumed > UNPACKER_READ_SIZE:
            self._grown = True
        if self._message_started is None:
            self._message_started = time.monotonic()
            self._message_at = self._consumed

    def next_message(self):
        """The next whole message, or _NO_MESSAGE; bytes that are not msgpack raise _BadMessage."""
        try:
            message = next(self._unpacker)
        except StopIteration:
            return _NO_MESSAGE
        except msgpack.BufferFull:
            raise _BadMessage(None, "message exceeds the size limit") from None
        except msgpack.StackError:
            raise _BadMessage(None, "message nested too deeply") from None
        except UnicodeDecodeError:
            raise _BadMessage(None, "a str that is not UTF-8") from None
        except TypeError:  # a map key msgpack can decode but that cannot be a key here (an array, a map)
            raise _BadMessage(None, "a map key must be a string, a number, a bool or nil") from None
        except (msgpack.UnpackException, ValueError):
            raise _BadMessage(None, "bytes that are not msgpack") from None
        self._consumed = self._unpacker.tell()  # exact right after a whole object
        self._message_started = time.monotonic()  # the next message starts here
        self._message_at = self._consumed
        return message

    def done_with_data(self):
        """Every whole message is handled: the deadline now runs only if part of one is buffered."""
        if self._fed == self._consumed:
            self._message_started = None
            if self._grown:  # a big message made the buffer grow: give it back
                self.resize()
        elif self._message_at != self._consumed or self._message_started is None:
            self._message_started = time.monotonic()
            self._message_at = self._consumed

    def timeout(self) -> float:
        now = time.monotonic()
        deadlines = [now + self._limits.idle_timeout_s]
        if not self._conn.authenticated:
            deadlines.append(self._conn.opened + self._limits.auth_timeout_s)
        if self._message_started is not None:
            deadlines.append(self._message_started + self._limits.message_timeout_s)
        return max(min(deadlines) - now, 0.0)

    def expired(self) -> str | None:
        """Why the connection must close now that a read timed out, or None to keep reading."""
        now = time.monotonic()
        if not self._conn.authenticated and now >= self._conn.opened + self._limits.auth_timeout_s:
            return f"no successful auth within {self._limits.auth_timeout_s:.0f}s"
        started = self._message_started
        if started is not None and now >= started + self._limits.message_timeout_s:
            return f"a message took more than {self._limits.message_timeout_s:.0f}s to arrive"
        if not self._conn.inflight and not self._conn.pending_calls:
            return f"idle for {self._limits.idle_timeout_s:.0f}s"
        return None


def _method_name(method, msgid) -> str:
    try:
        method = as_text(method, "method")  # bin method names, as old encoders send them
    except RPCError:
        method = None
    if not isinstance(method, str):
        raise _BadMessage(msgid, "method must be a UTF-8 string")
    return method


def _params_array(params) -> list:
    if isinstance(params, dict):  # liberal: a bare map means [map] (old Go net/rpc codecs send it so)
        return text_params([params])
    if params is None:
        return []
    if not isinstance(params, list):
        raise RPCError(INVALID_PARAMS, "params must be an array")
    return text_params(params)
