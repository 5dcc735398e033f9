"""The MessagePack-RPC server: asyncio for the sockets, one dedicated thread for the engine.

The engine is not thread-safe and a step can take long (a 512-token prefill chunk), so it runs on its own
thread (EngineWorker) that loops step() while there is work and takes adds/aborts/stats from an inbox
between steps. Its outputs come back to the event loop with call_soon_threadsafe, so the loop stays free
to answer `health` or accept connections while a step runs.
"""
from __future__ import annotations

import asyncio
import collections
import hmac
import itertools
import logging
import os
import queue
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import msgpack

from minisarathi.server.protocol import (ABORTED, CHUNK_NOTIFICATION, ERROR_NOTIFICATION, INTERNAL, INVALID_MESSAGE,
                                         INVALID_PARAMS, NOTIFICATION, OVERLOADED, PROMPT_TOO_LONG, REQUEST, RESPONSE,
                                         UNAUTHORIZED, UNKNOWN_METHOD, RPCError, ServerLimits, as_int, as_text,
                                         make_unpacker, pack, parse_generate, short, single_param, text_params)
from minisarathi.server.request_log import FinishedRequest, log_finished

log = logging.getLogger("minisarathi.server")

_READ_SIZE = 1 << 16
_CLIENT_ID_PREFIX = "msgpack:"   # engine ids of requests whose client named them
_WRITE_HIGH_WATER = 1 << 16   # unsent response bytes past which a connection's requests are not read
_CLOSE_LINGER_S = 5.0
_THROUGHPUT_WINDOW_S = 10.0


class EngineWorker:
    """Owns the engine: every engine call happens on this thread, in inbox order, between steps."""

    def __init__(self, engine, loop: asyncio.AbstractEventLoop, on_outputs, on_step_error):
        self.engine = engine
        self._loop = loop
        self._on_outputs = on_outputs          # called on the loop with list[RequestOutput]
        self._on_step_error = on_step_error    # called on the loop with the exception
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()   # callables, or None to stop
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)

    def start(self):
        self._thread.start()

    def stop(self):
        self._inbox.put(None)
        self._thread.join()

    def post(self, fn):
        """Run fn() on the engine thread; errors are logged."""
        self._inbox.put(fn)

    def call(self, fn) -> asyncio.Future:
        """Run fn() on the engine thread; the future (on the loop) gets its result or exception."""
        future = self._loop.create_future()

        def run():
            try:
                result, error = fn(), None
            except Exception as e:  # delivered to the caller, who decides what it means
                result, error = None, e
            self._loop.call_soon_threadsafe(_settle, future, result, error)
        self._inbox.put(run)
        return future

    def _run(self):
        while True:
            # Block only when idle; while requests run, take whatever arrived since the last step.
            commands = [] if self.engine.has_unfinished_requests() else [self._inbox.get()]
            while True:
                try:
                    commands.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
            for command in commands:
                if command is None:
                    return
                try:
                    command()
                except Exception:
                    log.exception("engine command failed")
            if self.engine.has_unfinished_requests():
                try:
                    steps = len(self.engine.step_records)
                    outputs = self.engine.step()
                    if log.isEnabledFor(logging.DEBUG) and len(self.engine.step_records) > steps:
                        _log_step(self.engine)
                except Exception as e:
                    log.exception("engine step failed")
                    self._loop.call_soon_threadsafe(self._on_step_error, e)
                    continue
                if outputs:
                    self._loop.call_soon_threadsafe(self._on_outputs, outputs)


def _public_id(request_id: str) -> str:
    """The id the client gave (or the generated req-N), without the engine's door prefix."""
    return request_id.removeprefix(_CLIENT_ID_PREFIX)


def _log_step(engine) -> None:
    step = engine.step_records[-1]
    log.debug("step", extra={"fields": {"decodes": step.num_decode_tokens, "prefill_tokens": step.num_prefill_tokens,
                                        "preempted": step.num_preempted,
                                        "kv_blocks_free": engine.block_manager.num_free_blocks,
                                        "step_s": round(step.step_time, 6)}})


def _settle(future: asyncio.Future, result, error):
    if future.done():
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)


class _Connection:
    def __init__(self, conn_id: int, writer: asyncio.StreamWriter, limits: ServerLimits, authenticated: bool,
                 peer: str = "unix"):
        self.id = conn_id
        self.writer = writer
        self.peer = peer   # the client's "host:port", for the request log
        self.limits = limits
        self.authenticated = authenticated
        self.inflight: dict[int, str] = {}    # msgid -> request id of its generate
        self.default_priority = 0             # of its requests that give none (e.g. its API key's, once known)
        self.closed = False

    def send(self, message):
        if self.closed:
            return
        self.writer.write(pack(message))
        if self.writer.transport.get_write_buffer_size() > self.limits.max_write_buffer_bytes:
            log.warning("conn=%d is not reading its responses; disconnecting", self.id)
            self.close()

    def respond(self, msgid: int, error: RPCError | None, result=None):
        self.send([RESPONSE, msgid, None if error is None else error.to_wire(), result])

    def protocol_error(self, msgid: int | None, error: RPCError):
        """A response when the msgid is known; otherwise a notification, since a response's msgid must be a
        uint32 and a made-up one could match a real request."""
        if msgid is None:
            self.send([NOTIFICATION, ERROR_NOTIFICATION, [error.to_wire()]])
        else:
            self.respond(msgid, error)

    def close(self, flush: bool = False):
        """Drop the socket; with flush, the client first gets what was written, if it takes it within
        _CLOSE_LINGER_S (a client that reads nothing would otherwise hold the socket and its buffer)."""
        if self.closed:
            return
        self.closed = True
        if not flush:
            self.writer.transport.abort()
            return
        self.writer.close()
        if self.writer.transport.get_write_buffer_size():
            asyncio.get_running_loop().call_later(_CLOSE_LINGER_S, self.writer.transport.abort)


@dataclass
class _Pending:
    """A generate request the server holds until its final response."""
    request_id: str
    conn: _Connection
    msgid: int
    stream: bool
    want_logprobs: bool
    prompt: str | list[int]
    prompt_tokens: int
    received: float                      # time.monotonic() when the request was read
    first_token_time: float | None = None
    sent: list[tuple[int, int]] = field(default_factory=list)   # per choice: (characters, token ids) streamed


class _BadMessage(Exception):
    """A message of the wrong shape: answered (when its msgid is known), then the connection closes."""

    def __init__(self, msgid, message: str):
        super().__init__(message)
        self.msgid = msgid


class Server:
    def __init__(self, engine, limits: ServerLimits | None = None, api_key: str | None = None,
                 model_name: str = ""):
        self.engine = engine
        self.limits = limits or ServerLimits()
        self._api_key = api_key
        self._model_name = model_name
        self._pending: dict[str, _Pending] = {}
        self._connections: set[_Connection] = set()
        self._request_ids = itertools.count()
        self._conn_ids = itertools.count()
        self._delivered: collections.deque = collections.deque()    # (time, tokens) in the throughput window
        self._started = time.monotonic()
        self._shutting_down = False
        self._servers: list[asyncio.AbstractServer] = []
        self._unix_socket: str | None = None
        self._worker: EngineWorker | None = None
        self._drained: asyncio.Event | None = None   # set whenever no request is pending
        self._tasks: set[asyncio.Task] = set()       # running async handlers (the loop keeps weak refs only)
        self._door_requests: dict[str, Callable] = {}   # engine request id -> on_output, for the other doors
        self.finish_listeners: list[Callable[[FinishedRequest], None]] = []   # called by report_finished
        # other doors (the HTTP door): `await start()` -> addresses, `await stop_accepting()`, `await stop()`
        self.doors: list = []

    # ---------------------------------------------------------------- lifecycle

    async def start(self, host: str | None = "127.0.0.1", port: int = 7000,
                    unix_socket: str | None = None) -> list[str]:
        """Start the engine thread and listen; returns the addresses ("HOST:PORT", "unix:PATH")."""
        loop = asyncio.get_running_loop()
        self._drained = asyncio.Event()
        self._drained.set()
        self._worker = EngineWorker(self.engine, loop, self._on_outputs, self._on_step_error)
        self._worker.start()
        addresses = []
        if host is not None:
            server = await asyncio.start_server(self._serve_connection, host, port, limit=_READ_SIZE)
            self._servers.append(server)
            addresses += [f"{s.getsockname()[0]}:{s.getsockname()[1]}" for s in server.sockets]
        if unix_socket is not None:
            server = await asyncio.start_unix_server(self._serve_connection, unix_socket, limit=_READ_SIZE)
            self._servers.append(server)
            self._unix_socket = unix_socket
            addresses.append(f"unix:{unix_socket}")
        for door in self.doors:
            addresses += await door.start()
        return addresses

    async def shutdown(self):
        """Stop accepting, give in-flight requests the grace period, abort the rest, close everything.

        The listeners close first, so a load balancer's next connection (or TCP health check) fails and goes
        to another replica; a connection with nothing in flight closes at once, and each other one as soon as
        its last request is answered, so a client's next request reconnects instead of meeting a draining
        server (docs/deploy.md)."""
        self._shutting_down = True
        for server in self._servers:
            server.close()
        for door in self.doors:
            await door.stop_accepting()
        for conn in list(self._connections):
            if not conn.inflight:
                conn.close(flush=True)
        if self._pending or self._door_requests:
            log.info("shutting down: waiting up to %.1fs for %d requests", self.limits.shutdown_grace_s,
                     len(self._pending) + len(self._door_requests))
            try:
                await asyncio.wait_for(self._drained.wait(), self.limits.shutdown_grace_s)
            except asyncio.TimeoutError:
                pass
        for pending in list(self._pending.values()):
            self._fail(pending, RPCError(ABORTED, "server shutting down"))
        self._fail_door_requests(RPCError(ABORTED, "server shutting down"))
        for door in self.doors:
            await door.stop()
        for conn in list(self._connections):
            conn.close(flush=True)
        for server in self._servers:
            await server.wait_closed()
        if self._unix_socket is not None and os.path.exists(self._unix_socket):
            os.unlink(self._unix_socket)
        await asyncio.get_running_loop().run_in_executor(None, self._worker.stop)
        log.info("server stopped")

    async def run(self, host: str | None, port: int, unix_socket: str | None = None):
        """Serve until SIGINT or SIGTERM, then shut down; prints one 'serving on' line per address."""
        addresses = await self.start(host, port, unix_socket)
        for address in addresses:
            print(f"minisarathi serving on {address}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        log.info("signal received")
        await self.shutdown()

    # ---------------------------------------------------------------- connections

    async def _serve_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        peer = writer.get_extra_info("peername")
        conn = _Connection(next(self._conn_ids), writer, self.limits, authenticated=self._api_key is None,
                           peer=f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else "unix")
        writer.transport.set_write_buffer_limits(high=_WRITE_HIGH_WATER)
        if self._shutting_down:   # accepted just before the listener closed: the client will go elsewhere
            conn.close()
            return
        if len(self._connections) >= self.limits.max_connections:
            log.warning("conn=%d refused: %d connections are open", conn.id, len(self._connections))
            conn.protocol_error(None, RPCError(OVERLOADED, f"more than {self.limits.max_connections} connections"))
            conn.close(flush=True)
            return
        self._connections.add(conn)
        log.info("conn=%d opened from %s", conn.id, writer.get_extra_info("peername") or "unix socket")
        unpacker = make_unpacker(self.limits)
        try:
            while not conn.closed:
                try:
                    data = await asyncio.wait_for(reader.read(_READ_SIZE), self.limits.idle_timeout_s)
                except asyncio.TimeoutError:
                    if conn.inflight:
                        continue
                    log.info("conn=%d idle for %.0fs; closing", conn.id, self.limits.idle_timeout_s)
                    break
                if not data:
                    break
                try:
                    for message in _messages(unpacker, data):
                        self._handle_message(conn, message)
                        if not await self._wait_for_reader(conn):
                            break
                except _BadMessage as e:
                    log.warning("conn=%d bad message: %s", conn.id, e)
                    conn.protocol_error(e.msgid, RPCError(INVALID_MESSAGE, str(e)))
                    break
        except (ConnectionError, OSError):
            pass
        finally:
            self._close_connection(conn)

    async def _wait_for_reader(self, conn: _Connection) -> bool:
        """Backpressure: take no more requests from a client that leaves its responses unread, so a
        pipelining client holds about _WRITE_HIGH_WATER bytes here, not all it asked for (streams it
        started still grow it, up to max_write_buffer_bytes). False when the connection is done."""
        if conn.closed or conn.writer.transport.get_write_buffer_size() <= _WRITE_HIGH_WATER:
            return not conn.closed
        try:
            await asyncio.wait_for(conn.writer.drain(), self.limits.idle_timeout_s)
        except asyncio.TimeoutError:
            log.warning("conn=%d left its responses unread for %.0fs; closing", conn.id, self.limits.idle_timeout_s)
            conn.close()
        return not conn.closed

    def _close_connection(self, conn: _Connection):
        conn.close(flush=True)   # an error about a bad message, say, still reaches the client
        self._connections.discard(conn)
        for request_id in list(conn.inflight.values()):
            pending = self._pending.get(request_id)
            if pending is not None:
                log.info("%s aborted: client disconnected", request_id)
                self._report_aborted(pending)
                self._forget(pending)
                self._worker.post(lambda rid=request_id: self.engine.abort_request(rid))
        log.info("conn=%d closed", conn.id)

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
            params = _params_array(params)
            if not conn.authenticated and method != "auth":
                raise RPCError(UNAUTHORIZED, "call auth with the API key first")
            handler = self._handlers.get(method)
            if handler is None:
                raise RPCError(UNKNOWN_METHOD, f"unknown method {short(repr(method))}")
            result = handler(self, conn, msgid, params)
        except RPCError as e:
            log.info("conn=%d msgid=%s %s failed: %s", conn.id, msgid, short(method), e)
            conn.respond(msgid, e)
        except Exception as e:
            log.exception("conn=%d msgid=%s %s failed", conn.id, msgid, method)
            conn.respond(msgid, RPCError(INTERNAL, f"{type(e).__name__}: {e}"))
        else:
            if asyncio.iscoroutine(result):
                task = asyncio.ensure_future(self._respond_later(conn, msgid, method, result))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            elif method != "generate":   # generate answers when the engine finishes it
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
            log.info("conn=%d notification %s failed: %s", conn.id, method, e)

    async def _respond_later(self, conn, msgid, method, coroutine):
        try:
            result = await coroutine
        except Exception as e:
            log.exception("conn=%d msgid=%s %s failed", conn.id, msgid, method)
            conn.respond(msgid, RPCError(INTERNAL, f"{type(e).__name__}: {e}"))
        else:
            conn.respond(msgid, None, result)

    # ---------------------------------------------------------------- methods

    def _generate(self, conn: _Connection, msgid: int, params: list):
        if self._shutting_down:
            if not conn.inflight:   # not taken: the closed connection tells the client to try elsewhere
                conn.close(flush=True)
                return None
            raise RPCError(OVERLOADED, "server is shutting down")
        request = parse_generate(params, self.limits)
        if msgid in conn.inflight:
            raise RPCError(INVALID_PARAMS, f"msgid {msgid} is already in flight on this connection")
        if len(conn.inflight) >= self.limits.max_inflight_per_connection:
            raise RPCError(OVERLOADED, f"more than {self.limits.max_inflight_per_connection} requests in flight "
                                       "on this connection")
        if len(self._pending) + len(self._door_requests) >= self.limits.max_queued_requests:
            raise RPCError(OVERLOADED, f"server queue is full ({self.limits.max_queued_requests} requests)")
        if request.prompt is not None:
            token_ids = self.engine.tokenizer.encode(request.prompt)
        else:
            token_ids = request.prompt_token_ids
            if max(token_ids) >= self.engine.tokenizer.vocab_size:
                raise RPCError(INVALID_PARAMS, f"prompt_token_ids must be < vocab_size "
                                               f"({self.engine.tokenizer.vocab_size})")
        limit = min(self.limits.max_prompt_tokens, self.engine.max_model_len)
        if len(token_ids) > limit:
            raise RPCError(PROMPT_TOO_LONG, f"prompt has {len(token_ids)} tokens; the limit is {limit}")
        if request.request_id is None:
            request_id = f"req-{next(self._request_ids)}"
        else:   # the door's prefix keeps the client's ids apart from the generated ones and the HTTP door's
            request_id = f"{_CLIENT_ID_PREFIX}{request.request_id}"
            if request_id in self._pending:
                raise RPCError(INVALID_PARAMS, f"request_id {request.request_id!r} is already in use")
        pending = _Pending(request_id, conn, msgid, request.stream, request.params.logprobs is not None,
                           request.prompt if request.prompt is not None else token_ids, len(token_ids),
                           time.monotonic())
        self._pending[request_id] = pending
        self._drained.clear()
        conn.inflight[msgid] = request_id
        priority = conn.default_priority if request.priority is None else request.priority
        log.info("%s conn=%d msgid=%d prompt_tokens=%d max_tokens=%d stream=%s priority=%d", request_id, conn.id,
                 msgid, len(token_ids), request.params.max_tokens, request.stream, priority)
        added = self._worker.call(lambda: self.engine.add_request(request_id, token_ids, request.params,
                                                                  arrival_time=pending.received,
                                                                  priority=priority))
        added.add_done_callback(lambda future: self._on_added(request_id, future))

    def _on_added(self, request_id: str, future: asyncio.Future):
        error = future.exception()
        pending = self._pending.get(request_id)
        if error is None or pending is None:
            return
        if isinstance(error, ValueError):
            log.info("%s rejected by the engine: %s", request_id, error)
            self._fail(pending, RPCError(INVALID_PARAMS, str(error)))
        else:
            log.error("%s add_request failed: %r", request_id, error)
            self._fail(pending, RPCError(INTERNAL, f"{type(error).__name__}: {error}"))

    def _abort(self, conn: _Connection, msgid: int, params: list) -> bool:
        """params [msgid] (of the generate call), or [{"request_id": id}] (the id given to generate)."""
        if len(params) == 1 and isinstance(params[0], dict) and "request_id" in params[0]:
            request_id = _CLIENT_ID_PREFIX + single_param(params, "request_id", str)
            if request_id not in conn.inflight.values():
                return False
        else:
            request_id = conn.inflight.get(single_param(params, "msgid", int))
        if request_id is None:
            return False   # unknown, or already finished
        log.info("%s aborted by the client", request_id)
        self._report_aborted(self._pending[request_id])
        self._fail(self._pending[request_id], RPCError(ABORTED, "aborted by the client"))
        self._worker.post(lambda: self.engine.abort_request(request_id))
        return True

    def _tokenize(self, conn, msgid, params) -> list[int]:
        return list(self.engine.tokenizer.encode(single_param(params, "text", str)))

    def _detokenize(self, conn, msgid, params) -> str:
        token_ids = [as_int(t) for t in single_param(params, "token_ids", list)]
        if not all(type(t) is int and 0 <= t < self.engine.tokenizer.vocab_size for t in token_ids):
            raise RPCError(INVALID_PARAMS, f"token_ids must be integers in [0, {self.engine.tokenizer.vocab_size})")
        return self.engine.tokenizer.decode(token_ids)

    def _model_info(self, conn, msgid, params) -> dict:
        config = self.engine.config
        return {"model": self._model_name, "vocab_size": self.engine.tokenizer.vocab_size,
                "max_model_len": self.engine.max_model_len, "eos_token_ids": list(self.engine.tokenizer.eos_token_ids),
                "scheduler": config.scheduler, "chunk_size": config.chunk_size, "block_size": config.block_size,
                "max_num_seqs": config.max_num_seqs, "device": config.device,
                "enable_prefix_caching": config.enable_prefix_caching,
                "tensor_parallel_size": config.tensor_parallel_size,
                "max_prompt_tokens": min(self.limits.max_prompt_tokens, self.engine.max_model_len),
                "max_tokens": self.limits.max_tokens}

    def _health(self, conn, msgid, params) -> dict:
        """"failed" (with the error) once the model cannot run any more (its tensor-parallel ranks died), so a
        load balancer's check takes the replica out."""
        if self.engine.model_failure is not None:
            return {"status": "failed", "error": str(self.engine.model_failure),
                    "uptime_s": time.monotonic() - self._started}
        return {"status": "shutting_down" if self._shutting_down else "ok",
                "uptime_s": time.monotonic() - self._started}

    async def _stats(self, conn, msgid, params) -> dict:
        engine_stats = await self._worker.call(self.engine.stats)
        now = time.monotonic()
        self._trim_throughput_window(now)
        window = min(_THROUGHPUT_WINDOW_S, now - self._started)
        return {**engine_stats,
                "connections": len(self._connections), "pending_requests": len(self._pending) + len(self._door_requests),
                "write_buffer_bytes": sum(c.writer.transport.get_write_buffer_size() for c in self._connections
                                          if not c.closed),
                "throughput_tokens_per_s": sum(n for _, n in self._delivered) / max(window, 1e-9),
                "uptime_s": now - self._started}

    def _auth(self, conn, msgid, params) -> bool:
        key = single_param(params, "api_key", str)
        if self._api_key is None:
            return True
        if not hmac.compare_digest(key.encode(), self._api_key.encode()):
            conn.authenticated = False
            raise RPCError(UNAUTHORIZED, "wrong API key")
        conn.authenticated = True
        return True

    _handlers = {"generate": _generate, "abort": _abort, "tokenize": _tokenize, "detokenize": _detokenize,
                 "model_info": _model_info, "health": _health, "stats": _stats, "auth": _auth}

    # ---------------------------------------------------------------- engine outputs (on the loop)

    def _on_outputs(self, outputs):
        now = time.monotonic()
        for output in outputs:
            pending = self._pending.get(output.request_id)
            if pending is None:
                self._deliver_to_door(output)   # or aborted or failed while the engine was stepping
                continue
            try:
                self._deliver(pending, output, now)
            except Exception as e:   # one bad output must not strand the others of this step
                log.exception("%s delivering output failed", pending.request_id)
                self._fail(pending, RPCError(INTERNAL, f"{type(e).__name__}: {e}"))
                self._worker.post(lambda rid=pending.request_id: self.engine.abort_request(rid))
        self._trim_throughput_window(now)

    def _deliver(self, pending: _Pending, output, now: float):
        for completion in output.outputs:   # n > 1: every choice's chunks carry its index
            if completion.index == len(pending.sent):
                pending.sent.append((0, 0))
            sent_chars, sent_tokens = pending.sent[completion.index]
            piece = completion.text[sent_chars:]
            new_ids = list(completion.token_ids[sent_tokens:])
            if new_ids:
                if pending.first_token_time is None:
                    pending.first_token_time = now
                self._delivered.append((now, len(new_ids)))
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
        result = {"request_id": _public_id(pending.request_id), **choices[0],
                  "prompt_tokens": pending.prompt_tokens, "completion_tokens": completion_tokens,
                  "cached_tokens": output.num_cached_tokens,
                  "ttft_s": None if pending.first_token_time is None else pending.first_token_time - pending.received,
                  "e2e_s": now - pending.received}
        if len(choices) > 1:
            result["choices"] = [{"index": i, **choice} for i, choice in enumerate(choices)]
        self.report_finished(FinishedRequest(
            _public_id(pending.request_id), "msgpack", pending.conn.peer, pending.prompt, pending.prompt_tokens,
            output.num_cached_tokens, completion_tokens, output.outputs[0].finish_reason, output.metrics))
        self._forget(pending)
        pending.conn.respond(pending.msgid, None, result)
        self._close_if_drained(pending.conn)

    @staticmethod
    def _choice_result(pending: _Pending, completion) -> dict:
        result = {"text": completion.text, "token_ids": list(completion.token_ids),
                  "finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason}
        if pending.want_logprobs:
            result["logprobs"] = [[{"token_id": token_id, "logprob": lp.logprob, "rank": lp.rank,
                                    "decoded_token": lp.decoded_token} for token_id, lp in position.items()]
                                  for position in completion.logprobs or []]
        return result

    def _on_step_error(self, error: Exception):
        # The engine's state is suspect after a failed step: fail everything it holds.
        for pending in list(self._pending.values()):
            self._fail(pending, RPCError(INTERNAL, f"engine step failed: {type(error).__name__}: {error}"))
            self._worker.post(lambda rid=pending.request_id: self.engine.abort_request(rid))
        self._fail_door_requests(RPCError(INTERNAL, f"engine step failed: {type(error).__name__}: {error}"))

    def _fail(self, pending: _Pending, error: RPCError):
        self._forget(pending)
        pending.conn.respond(pending.msgid, error)
        self._close_if_drained(pending.conn)

    def _close_if_drained(self, conn: _Connection):
        if self._shutting_down and not conn.inflight:
            conn.close(flush=True)

    def _forget(self, pending: _Pending):
        self._pending.pop(pending.request_id, None)
        pending.conn.inflight.pop(pending.msgid, None)
        self._check_drained()

    def report_finished(self, finished: FinishedRequest) -> None:
        """Either door, once per request: its log line, then the listeners (metrics)."""
        log_finished(finished)
        for listener in self.finish_listeners:
            listener(finished)

    def _report_aborted(self, pending: _Pending) -> None:
        self.report_finished(FinishedRequest(_public_id(pending.request_id), "msgpack", pending.conn.peer,
                                             pending.prompt, pending.prompt_tokens, 0, sum(t for _, t in pending.sent), "abort",
                                             None))

    # ---------------------------------------------------------------- the other doors' requests (on the loop)

    @property
    def accepting(self) -> bool:
        """False once shutdown began or the model failed (the HTTP door's /ready)."""
        return not self._shutting_down and self.engine.model_failure is None

    def check_api_key(self, key: str | None) -> bool:
        return self._api_key is None or (key is not None and hmac.compare_digest(key.encode(), self._api_key.encode()))

    def engine_call(self, fn) -> asyncio.Future:
        """Run fn() on the engine thread between steps (e.g. engine.stats for a metrics scrape)."""
        return self._worker.call(fn)

    def submit(self, request_id: str, token_ids: list[int], params, on_output, arrival_time: float,
               priority: int | None = None) -> None:
        """Queue a request of another door under the same limits as `generate`. on_output is called on the loop
        with each of its RequestOutputs (the last one finished), or once with an RPCError if it fails.
        priority: lower runs first; None: 0."""
        if self._shutting_down:
            raise RPCError(OVERLOADED, "server is shutting down")
        if len(self._pending) + len(self._door_requests) >= self.limits.max_queued_requests:
            raise RPCError(OVERLOADED, f"server queue is full ({self.limits.max_queued_requests} requests)")
        if request_id in self._door_requests:
            raise RPCError(INVALID_PARAMS, f"request id {short(request_id)} is already in use")
        self._door_requests[request_id] = on_output
        self._drained.clear()
        priority = 0 if priority is None else priority
        added = self._worker.call(lambda: self.engine.add_request(request_id, token_ids, params,
                                                                  arrival_time=arrival_time, priority=priority))
        added.add_done_callback(lambda future: self._on_door_added(request_id, future))

    def cancel(self, request_id: str) -> None:
        """Abort a door's request (its client went away); its outputs are no longer delivered."""
        if self._door_requests.pop(request_id, None) is not None:
            self._worker.post(lambda: self.engine.abort_request(request_id))
            self._check_drained()

    def _on_door_added(self, request_id: str, future: asyncio.Future):
        error = future.exception()
        if error is None or request_id not in self._door_requests:
            return
        on_output = self._door_requests.pop(request_id)
        self._check_drained()
        if isinstance(error, ValueError):
            on_output(RPCError(INVALID_PARAMS, str(error)))
        else:
            log.error("%s add_request failed: %r", request_id, error)
            on_output(RPCError(INTERNAL, "the engine failed to add the request"))

    def _deliver_to_door(self, output):
        on_output = self._door_requests.get(output.request_id)
        if on_output is None:
            return
        if output.finished:
            del self._door_requests[output.request_id]
            self._check_drained()
        on_output(output)

    def _fail_door_requests(self, error: RPCError):
        for request_id, on_output in list(self._door_requests.items()):
            del self._door_requests[request_id]
            self._worker.post(lambda rid=request_id: self.engine.abort_request(rid))
            on_output(error)
        self._check_drained()

    def _check_drained(self):
        if not self._pending and not self._door_requests:
            self._drained.set()

    def _trim_throughput_window(self, now: float):
        while self._delivered and self._delivered[0][0] < now - _THROUGHPUT_WINDOW_S:
            self._delivered.popleft()


def _is_msgid(value) -> bool:
    return type(value) is int and 0 <= value < 2**32


def _messages(unpacker: msgpack.Unpacker, data: bytes):
    """Feed data, then yield every whole message; bytes that are not msgpack raise _BadMessage."""
    try:
        unpacker.feed(data)
    except msgpack.BufferFull:
        raise _BadMessage(None, "message exceeds the size limit") from None
    while True:
        try:
            yield next(unpacker)
        except StopIteration:
            return
        except msgpack.BufferFull:
            raise _BadMessage(None, "message exceeds the size limit") from None
        except msgpack.StackError:
            raise _BadMessage(None, "message nested too deeply") from None
        # TypeError: a map key msgpack can decode but Python cannot hash (an array)
        except (msgpack.UnpackException, ValueError, TypeError) as e:
            detail = f": {short(str(e))}" if str(e) else ""
            raise _BadMessage(None, f"malformed msgpack ({type(e).__name__}{detail})") from None


def _method_name(method, msgid) -> str:
    try:
        method = as_text(method, "method")   # bin method names, as old encoders send them
    except RPCError:
        method = None
    if not isinstance(method, str):
        raise _BadMessage(msgid, "method must be a UTF-8 string")
    return method


def _params_array(params) -> list:
    if isinstance(params, dict):   # liberal: a bare map means [map] (old Go net/rpc codecs send it so)
        return text_params([params])
    if params is None:
        return []
    if not isinstance(params, list):
        raise RPCError(INVALID_PARAMS, "params must be an array")
    return text_params(params)
