"""The MessagePack-RPC server: asyncio for the sockets, one dedicated thread for the engine.

The engine is not thread-safe and a step can take long (a 512-token prefill chunk), so it runs on its own
thread (EngineWorker) that loops step() while there is work and takes adds/aborts/stats from an inbox
between steps. Its outputs come back to the event loop with call_soon_threadsafe, so the loop stays free
to answer `health` or accept connections while a step runs.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import itertools
import logging
import os
import queue
import signal
import socket
import ssl
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import msgpack

from minisarathi.backends.cpu.process_setup import release_free_memory
from minisarathi.engine.step_log import step_time_summary
from minisarathi.server.auth import AuthThrottle, Key, KeyStore, Quota
from minisarathi.server.protocol import (
    ABORTED, CHUNK_NOTIFICATION, ERROR_NOTIFICATION, INTERNAL, INVALID_MESSAGE, INVALID_PARAMS, NOTIFICATION,
    OVERLOADED, PROMPT_TOO_LONG, RATE_LIMITED, REQUEST, RESPONSE, UNAUTHORIZED, UNKNOWN_METHOD, RPCError,
    UNPACKER_READ_SIZE, ServerLimits, as_text, make_unpacker, pack, parse_generate, short, single_param,
    text_params, token_id_list)
from minisarathi.server.request_log import FinishedRequest, log_finished

log = logging.getLogger("minisarathi.server")

_READ_SIZE = 1 << 16
_CLIENT_ID_PREFIX = "msgpack:"   # engine ids of requests whose client named them
_UNAUTHENTICATED_READ_SIZE = 1 << 12
# Unsent output (the transport's buffer) past which a connection's requests are not read and its running
# requests are paused: its client has stopped reading.
_WRITE_HIGH_WATER = 1 << 16
# The kernel's share of unread output, bounded too: with autotuning a loopback socket buffers ~2.8 MB,
# enough to hide hundreds of unread streams from the check above. Linux doubles SO_SNDBUF.
_SOCKET_SNDBUF = 32 << 10
_TCP_NOTSENT_LOWAT = 16 << 10
_CLOSE_LINGER_S = 5.0
_THROUGHPUT_WINDOW_S = 10.0
# Text longer than this is tokenized on a worker thread (tokenizers releases the GIL): ~4 ms on the loop at most.
_INLINE_TOKENIZE_CHARS = 4096
_INLINE_DETOKENIZE_TOKENS = 4096
_MAX_AUTH_FAILURES_PER_CONNECTION = 16
# Big tokenize/detokenize calls are bulk work for one client: the tokenizer thread runs them this much nicer
# than the rest of the server, so when the cores are short the engine's steps (every client's tokens), the
# event loop and the small calls it answers inline go first.
TOKENIZER_NICE_INCREMENT = 10
# stats' steps_since summarizes at most this many steps: the summary holds the loop (and the GIL) ~0.2 ms for
# 1024 (0.56 ms for 4096, 1-2 ms on a busy server), like a short prompt's encode; the latest 1024 steps of a
# steady load are a second of it on the bundled model
STEP_SUMMARY_MAX_STEPS = 1024
IDLE_RELEASE_S = 1.0   # idle this long, the engine thread gives back the memory kept free for steps


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

    def post_unless_error(self, fn, on_error):
        """Run fn() on the engine thread; only if it raises, on_error(exception) is called on the loop. Unlike
        call(), success costs the loop nothing: no wake-up (the engine thread's write to the loop's self-pipe,
        which also hands the GIL over between the two threads) and no callback."""
        def run():
            try:
                fn()
            except Exception as e:  # delivered to the caller, who decides what it means
                self._loop.call_soon_threadsafe(on_error, e)
        self._inbox.put(run)

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

    def _next_command_when_idle(self):
        """The next command; if none comes within IDLE_RELEASE_S, the memory glibc keeps free for steps is
        given back first (process_setup.release_free_memory): an idle server's RSS is then what it holds, not its
        highest peak so far (over a soak's rounds RSS crept up with each new peak). Back-to-back requests keep
        the kept memory, and with it steps free of page faults."""
        try:
            return self._inbox.get(timeout=IDLE_RELEASE_S)
        except queue.Empty:
            release_free_memory()
            return self._inbox.get()

    def _run(self):
        while True:
            # Block only when idle (or every request is paused); while requests run, take whatever arrived
            # since the last step.
            commands = [] if self.engine.has_work() else [self._next_command_when_idle()]
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
            if self.engine.has_work():
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


def _lower_thread_priority() -> None:
    """The calling thread's nice value raised by TOKENIZER_NICE_INCREMENT (Linux sets it per thread; elsewhere
    it would apply to the whole process, so it is left alone there)."""
    if sys.platform.startswith("linux"):
        thread = threading.get_native_id()
        try:
            os.setpriority(os.PRIO_PROCESS, thread,
                           min(19, os.getpriority(os.PRIO_PROCESS, thread) + TOKENIZER_NICE_INCREMENT))
        except OSError as e:   # e.g. a seccomp profile: the thread pool must still work (an initializer that
            log.warning("the tokenizer thread keeps its priority: %s", e)   # raises breaks it for good)


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
                 peer: str = "unix", on_stall=None):
        self.id = conn_id
        self.writer = writer
        self.peer = peer                      # the client's "host:port", for the request log
        self.address = peer.rpartition(":")[0] if peer != "unix" else peer   # its IP, for per-address limits
        self.limits = limits
        self.authenticated = authenticated
        self.opened = time.monotonic()        # also reset when an auth is revoked: the auth deadline runs from it
        self.key: Key | None = None           # the key it authenticated with (None without keys)
        self.inflight: dict[int, str] = {}    # msgid -> request id of its generate
        self.default_priority = 0             # of its requests that give none: its API key's
        self.pending_calls = 0                # other calls being answered (tokenize, stats, ...)
        self.call_done = asyncio.Event()      # set when pending_calls drops
        self.tasks: set[asyncio.Task] = set()  # its calls being answered and prompts being tokenized: cancelled
                                               # when it closes, so its queued tokenizer work goes with it
        self.auth_failures = 0
        self.auth_delay = 0.0                 # seconds to wait before reading on, after a failed auth
        self.stalled = False                  # its output waits unread: its requests are paused
        self._on_stall = on_stall             # called once each time the output backs up
        self._held: list[bytes] | None = None  # while corked: the packed messages sent, in order
        self.output_ended = False             # end_output() was called: nothing more is sent
        self.closed = False

    def send(self, message):
        if self.closed or self.output_ended:
            return
        if self._held is not None:
            self._held.append(pack(message))
            return
        self._write(pack(message))

    def cork(self):
        """Hold what is sent until uncork(), which writes it in one piece. The server corks a connection while it
        delivers one engine step's outputs: the chunks of many streams then cost one socket write, not one
        each (each write is a syscall that lets the engine thread take the GIL, then waits to get it back)."""
        if self._held is None:
            self._held = []

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
        elif buffered > _WRITE_HIGH_WATER and not self.stalled and self._on_stall is not None:
            self.stalled = True
            self._on_stall(self)

    def buffered(self) -> int:
        """Output written but not yet taken by the kernel."""
        try:
            return self.writer.transport.get_write_buffer_size()
        except AttributeError:   # a closed TLS transport (CPython's sslproto drops its protocol on close)
            return 0

    def respond(self, msgid: int, error: RPCError | None, result=None):
        self.send([RESPONSE, msgid, None if error is None else error.to_wire(), result])

    def protocol_error(self, msgid: int | None, error: RPCError):
        """A response when the msgid is known; otherwise a notification, since a response's msgid must be a
        uint32 and a made-up one could match a real request."""
        if msgid is None:
            self.send([NOTIFICATION, ERROR_NOTIFICATION, [error.to_wire()]])
        else:
            self.respond(msgid, error)

    def end_output(self) -> bool:
        """Send the end of the stream after what was written (the socket stays open for reading); False where the
        transport cannot (TLS)."""
        if self.closed or not self.writer.can_write_eof():
            return False
        self.uncork()
        if self.closed:
            return False
        self.writer.write_eof()
        self.output_ended = True
        return True

    def close(self, flush: bool = False):
        """Drop the socket; with flush, the client first gets what was written, if it takes it within
        _CLOSE_LINGER_S (a client that reads nothing would otherwise hold the socket and its buffer)."""
        if self.closed:
            return
        if flush:
            self.uncork()    # what was held goes out first
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
    """A generate request the server holds until its final response."""
    request_id: str
    conn: _Connection
    msgid: int
    stream: bool
    want_logprobs: bool
    prompt: str | list[int]
    received: float                      # time.monotonic() when the request was read
    prompt_tokens: int = 0               # known once tokenized
    first_token_time: float | None = None
    sent: list[tuple[int, int]] = field(default_factory=list)   # per choice: (characters, token ids) streamed
    quota: Quota | None = None           # the key's quota it was charged to, and how many tokens
    charged_tokens: int = 0


class ListenError(OSError):
    """A listener could not be opened; `listener` says which: "tcp", "unix", or the door (in Server.doors)."""

    def __init__(self, listener, error: OSError):
        super().__init__(error.errno, error.strerror or str(error))
        self.listener = listener


class _BadMessage(Exception):
    """A message of the wrong shape: answered (when its msgid is known), then the connection closes."""

    def __init__(self, msgid, message: str):
        super().__init__(message)
        self.msgid = msgid


class Server:
    def __init__(self, engine, limits: ServerLimits | None = None, keys: KeyStore | None = None,
                 model_name: str = "", tls: ssl.SSLContext | None = None):
        self.engine = engine
        self.limits = limits or ServerLimits()
        self.keys = keys                       # None: no auth
        self._model_name = model_name          # the model folder's name, never its path
        self._tls = tls
        self._pending: dict[str, _Pending] = {}
        self._connections: set[_Connection] = set()
        self._unauthenticated: dict[_Connection, None] = {}   # oldest first
        self._request_ids = itertools.count()
        self._conn_ids = itertools.count()
        self._delivered: collections.deque = collections.deque()    # (time, tokens) in the throughput window
        self._started = time.monotonic()
        self._leaving = False           # shutdown began: /ready answers 503 (requests are still served until
        self._shutting_down = False     # this is set, drain_delay_s later)
        self._servers: list[asyncio.AbstractServer] = []
        self._unix_socket: str | None = None
        self._worker: EngineWorker | None = None
        self._drained: asyncio.Event | None = None   # set whenever no request is pending
        self._tasks: set[asyncio.Task] = set()       # running stall watchers (the loop keeps weak refs only)
        self._door_requests: dict[str, Callable] = {}   # engine request id -> on_output, for the other doors
        self.finish_listeners: list[Callable[[FinishedRequest], None]] = []   # called by report_finished
        # other doors (the HTTP door): `await start()` -> addresses, `await stop_accepting()`, `await stop()`
        self.doors: list = []
        # One thread for big tokenize/detokenize work: off the loop, and one at a time, so a flood of them
        # queues (holding only its inputs) instead of taking every core; at a lower CPU priority. Small calls
        # (the bystander's) are answered on the loop, never queued behind big ones.
        self._text_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tokenizer",
                                                                initializer=_lower_thread_priority)
        self._throttle = AuthThrottle()
        self._counters = collections.Counter()       # paused, unread_aborts, connections_evicted, ...
        # A prompt of more bytes than this has more tokens than any limit allows, whatever its text:
        # rejected before it is tokenized (see _longest_token_bytes).
        self.max_prompt_tokens = min(self.limits.max_prompt_tokens, engine.max_model_len)   # both doors'
        self._max_prompt_bytes = self.max_prompt_tokens * _longest_token_bytes(engine.tokenizer)
        self._max_inflight = min(self.limits.max_inflight_per_connection, engine.config.max_num_seqs)

    # ---------------------------------------------------------------- lifecycle

    async def start(self, host: str | None = "127.0.0.1", port: int = 7000,
                    unix_socket: str | None = None) -> list[str]:
        """Start the engine thread and listen; returns the addresses ("HOST:PORT", "unix:PATH"). A listener
        that cannot be opened raises ListenError, which says which one."""
        loop = asyncio.get_running_loop()
        self._drained = asyncio.Event()
        self._drained.set()
        self._worker = EngineWorker(self.engine, loop, self._on_outputs, self._on_step_error)
        self._worker.start()
        tls = {} if self._tls is None else {"ssl": self._tls, "ssl_handshake_timeout": self.limits.auth_timeout_s}
        addresses = []
        listener = "tcp"   # the one being opened, named by ListenError
        try:
            if host is not None:
                # The listen backlog holds a burst of connections as large as the server takes (asyncio's default,
                # 100, reset some of a 1000-connection burst's while the loop was busy accepting).
                server = await asyncio.start_server(self._serve_connection, host, port, limit=_READ_SIZE,
                                                    backlog=min(self.limits.max_connections, socket.SOMAXCONN), **tls)
                self._servers.append(server)
                addresses += [f"{s.getsockname()[0]}:{s.getsockname()[1]}" for s in server.sockets]
            listener = "unix"
            if unix_socket is not None:
                server = await asyncio.start_unix_server(self._serve_connection, unix_socket, limit=_READ_SIZE,
                                                         **tls)
                self._servers.append(server)
                self._unix_socket = unix_socket
                addresses.append(f"unix:{unix_socket}")
            for door in self.doors:
                listener = door
                addresses += await door.start()
        except OSError as e:
            raise ListenError(listener, e) from None
        return addresses

    async def shutdown(self):
        """Stop accepting, give in-flight requests the grace period, abort the rest, close everything.

        The listeners close first, so a load balancer's next connection (or TCP health check) fails and goes
        to another replica; a connection with nothing in flight closes at once, and each other one as soon as
        its last request is answered, so a client's next request reconnects instead of meeting a draining
        server (docs/deploy.md). With a drain delay, /ready first answers 503 while everything else is served
        as before, long enough for a balancer's health checks to take the replica out: no request of its
        then meets a refusal that it would have to retry."""
        self._leaving = True
        if self.limits.drain_delay_s > 0:
            log.info("shutting down: /ready answers 503; serving on for %.1fs first", self.limits.drain_delay_s)
            await asyncio.sleep(self.limits.drain_delay_s)
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
        self._text_pool.shutdown(cancel_futures=True)
        log.info("server stopped")

    async def run(self, host: str | None, port: int, unix_socket: str | None = None):
        """Serve until SIGINT or SIGTERM, then shut down; prints one 'serving on' line per address.
        SIGHUP reloads the keys file."""
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):   # before the addresses are printed: a supervisor may signal then
            loop.add_signal_handler(sig, stop.set)
        loop.add_signal_handler(signal.SIGHUP, self.reload_keys)
        addresses = await self.start(host, port, unix_socket)
        for address in addresses:
            print(f"minisarathi serving on {address}", flush=True)
        await stop.wait()
        log.info("signal received")
        await self.shutdown()
        # Closing the loop would put back the default action (death by signal) while the process still exits:
        # a repeated SIGTERM from a supervisor would then turn a clean drain into exit status -15.
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
            signal.signal(sig, signal.SIG_IGN)

    def reload_keys(self):
        """Re-read the keys file; connections stay, each keeping its key if the file still has it."""
        if self.keys is None or self.keys.path is None:
            log.warning("SIGHUP: no keys file to reload")
            return
        try:
            self.keys.reload()
        except ValueError as e:
            log.error("keys not reloaded, the old ones stay in force: %s", e)
            return
        for conn in list(self._connections):
            if conn.key is not None:
                key = self.keys.current(conn.key)
                if key is None:
                    self._revoke(conn)
                conn.key = key
        log.info("keys reloaded from %s", self.keys.path)

    # ---------------------------------------------------------------- connections

    async def _serve_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        peer = writer.get_extra_info("peername")
        conn = _Connection(next(self._conn_ids), writer, self.limits, authenticated=self.keys is None,
                           peer=f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else "unix", on_stall=self._on_stall)
        writer.transport.set_write_buffer_limits(high=_WRITE_HIGH_WATER)
        if self._shutting_down:   # accepted just before the listener closed: the client will go elsewhere
            conn.close()
            return
        _bound_kernel_buffer(writer)
        if not self._admit_connection(conn):
            return
        log.debug("conn=%d opened from %s", conn.id, peer or "unix socket")
        reading = _Reader(conn, self.limits)
        try:
            while not conn.closed:
                try:
                    # asyncio.timeout, not wait_for: the read runs in this task, not in one made per read, so a
                    # message costs the loop two iterations (each a GIL hand-over with the engine thread) less
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
                    if conn.authenticated and not was_authenticated:   # the full message size from now on
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
        """Before a connection closes on a bad message: the error, then the end of the stream, and what the client
        still sends read and dropped, up to 2 x max_message_bytes for _CLOSE_LINGER_S at most. A socket closed with
        unread input is reset: a client still sending its (say oversized) message would get the reset, not the
        error, and one reading would see a reset after the error instead of the end of the stream."""
        if not conn.end_output():
            return
        self._drop_requests(conn)   # their outputs could not be sent any more
        budget = 2 * self.limits.max_message_bytes
        try:
            async with asyncio.timeout(_CLOSE_LINGER_S):
                while budget > 0 and (data := await reader.read(min(budget, _READ_SIZE))):
                    budget -= len(data)
        except (TimeoutError, ConnectionError, OSError):
            pass

    def _admit_connection(self, conn: _Connection) -> bool:
        """Without keys: at most max_connections. With keys, an unauthenticated connection always gets in,
        closing the oldest unauthenticated one of its address (or of all) past their limits: a flood of
        connections without the key never locks a key holder out, and costs the flooder its own oldest."""
        if conn.authenticated:
            if self._num_authenticated() >= self.limits.max_connections:
                self._refuse(conn, f"more than {self.limits.max_connections} connections")
                return False
        else:
            same_address = [c for c in self._unauthenticated if c.address == conn.address]
            if len(same_address) >= self.limits.max_unauthenticated_per_address:
                self._evict(same_address[0])
            if len(self._unauthenticated) >= self.limits.max_unauthenticated_connections:
                self._evict(next(iter(self._unauthenticated)))
            self._unauthenticated[conn] = None
        self._connections.add(conn)
        return True

    def _num_authenticated(self) -> int:
        return sum(1 for c in self._connections if c.authenticated and not c.closed)

    def _refuse(self, conn: _Connection, why: str):
        log.warning("conn=%d refused: %s", conn.id, why)
        conn.protocol_error(None, RPCError(OVERLOADED, why))
        conn.close(flush=True)

    def _evict(self, conn: _Connection):
        self._counters["unauthenticated_evicted"] += 1
        self._unauthenticated.pop(conn, None)
        conn.close()

    def _authenticated(self, conn: _Connection, key: Key) -> bool:
        """auth succeeded: the connection leaves the unauthenticated pool, if there is room for it."""
        if not conn.authenticated:
            if self._num_authenticated() >= self.limits.max_connections:
                return False
            self._unauthenticated.pop(conn, None)
        conn.authenticated = True
        conn.key = key
        return True

    def _revoke(self, conn: _Connection):
        if conn.authenticated and self.keys is not None:
            conn.authenticated = False
            conn.opened = time.monotonic()
            self._unauthenticated[conn] = None

    async def _throttle_reading(self, conn: _Connection) -> bool:
        """Pause reading a connection: after a failed auth (its backoff), while its answers wait unread, and
        while it has max_pending_calls_per_connection calls unanswered. False when the connection is done."""
        if conn.auth_delay:
            delay, conn.auth_delay = conn.auth_delay, 0.0
            await asyncio.sleep(delay)
        while conn.pending_calls >= self.limits.max_pending_calls_per_connection and not conn.closed:
            conn.call_done.clear()
            await conn.call_done.wait()
        return await self._wait_for_reader(conn)

    async def _wait_for_reader(self, conn: _Connection) -> bool:
        """Backpressure: take no more requests from a client that leaves its responses unread, so a
        pipelining client holds about _WRITE_HIGH_WATER bytes here, not all it asked for. False when the
        connection is done."""
        if conn.closed or conn.buffered() <= _WRITE_HIGH_WATER:
            return not conn.closed
        try:
            await asyncio.wait_for(conn.writer.drain(), self.limits.unread_timeout_s)
        except asyncio.TimeoutError:
            log.warning("conn=%d left its responses unread for %.0fs; closing", conn.id, self.limits.unread_timeout_s)
            conn.close()
        except (ConnectionError, OSError):
            conn.close()
        return not conn.closed

    def _on_stall(self, conn: _Connection):
        """The client stopped reading: pause its requests (their batch slots go to others), resume them when
        it reads again, abort them (closing the connection) if it does not within unread_timeout_s."""
        self._set_paused(conn, True)
        task = asyncio.ensure_future(self._await_unstall(conn))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _await_unstall(self, conn: _Connection):
        try:
            await asyncio.wait_for(conn.writer.drain(), self.limits.unread_timeout_s)
        except asyncio.TimeoutError:
            log.warning("conn=%d left %d requests unread for %.0fs; aborting them", conn.id, len(conn.inflight),
                        self.limits.unread_timeout_s)
            self._counters["unread_aborts"] += len(conn.inflight)
            conn.close()
            return
        except (ConnectionError, OSError):
            conn.close()
            return
        conn.stalled = False
        if not conn.closed:
            self._set_paused(conn, False)

    def _set_paused(self, conn: _Connection, paused: bool):
        request_ids = list(conn.inflight.values())
        if not request_ids:
            return
        self._counters["paused" if paused else "resumed"] += len(request_ids)
        hook = self.engine.pause_request if paused else self.engine.resume_request

        def apply():
            for request_id in request_ids:
                hook(request_id)
        self._worker.post(apply)

    def _close_connection(self, conn: _Connection):
        conn.close(flush=True)   # an error about a bad message, say, still reaches the client
        self._connections.discard(conn)
        self._unauthenticated.pop(conn, None)
        self._drop_requests(conn)
        log.debug("conn=%d closed", conn.id)

    def _drop_requests(self, conn: _Connection):
        """Cancel the connection's calls being answered and abort its requests."""
        conn.call_done.set()
        for task in list(conn.tasks):   # its tokenize calls still queued for the tokenizer thread, say
            task.cancel()
        for request_id in list(conn.inflight.values()):
            pending = self._pending.get(request_id)
            if pending is not None:
                log.info("%s aborted: client disconnected", request_id)
                self._report_aborted(pending)
                self._forget(pending)
                self._worker.post(lambda rid=request_id: self.engine.abort_request(rid))

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
            if not conn.authenticated and method != "auth":
                raise RPCError(UNAUTHORIZED, "call auth with the API key first")
            handler = self._handlers.get(method)
            if handler is None:
                raise RPCError(UNKNOWN_METHOD, f"unknown method {short(repr(method))}")
            result = handler(self, conn, msgid, _params_array(params))
        except RPCError as e:
            if e.code != UNAUTHORIZED:   # those are counted and summarized by the throttle
                log.info("conn=%d msgid=%s %s failed: %s", conn.id, msgid, short(method), e)
            conn.respond(msgid, e)
        except Exception:
            log.exception("conn=%d msgid=%s %s failed", conn.id, msgid, method)
            conn.respond(msgid, _internal_error())
        else:
            if asyncio.iscoroutine(result):
                conn.pending_calls += 1
                self._start_task(conn, self._respond_later(conn, msgid, method, result))
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
            if e.code != UNAUTHORIZED:
                log.info("conn=%d notification %s failed: %s", conn.id, method, e)

    def _start_task(self, conn: _Connection, coroutine):
        task = asyncio.ensure_future(coroutine)
        conn.tasks.add(task)
        task.add_done_callback(conn.tasks.discard)

    async def _respond_later(self, conn, msgid, method, coroutine):
        try:
            result = await coroutine
        except RPCError as e:
            log.info("conn=%d msgid=%s %s failed: %s", conn.id, msgid, short(method), e)
            conn.respond(msgid, e)
        except Exception:
            log.exception("conn=%d msgid=%s %s failed", conn.id, msgid, method)
            conn.respond(msgid, _internal_error())
        else:
            conn.respond(msgid, None, result)
        finally:
            conn.pending_calls -= 1
            conn.call_done.set()

    # ---------------------------------------------------------------- methods

    def _generate(self, conn: _Connection, msgid: int, params: list):
        if self._shutting_down:
            if not conn.inflight:   # not taken: the closed connection tells the client to try elsewhere
                conn.close(flush=True)
                return None
            raise RPCError(OVERLOADED, "server is shutting down")
        request = parse_generate(params, self.limits)
        key_cap = None if conn.key is None else conn.key.max_tokens
        if key_cap is not None and request.params.max_tokens > key_cap:
            raise RPCError(INVALID_PARAMS, f"max_tokens must be <= {key_cap} for this key, "
                                           f"got {request.params.max_tokens}")
        if msgid in conn.inflight:
            raise RPCError(INVALID_PARAMS, f"msgid {msgid} is already in flight on this connection")
        if len(conn.inflight) >= self._max_inflight:
            raise RPCError(OVERLOADED, f"more than {self._max_inflight} requests in flight on this connection")
        if len(self._pending) + len(self._door_requests) >= self.limits.max_queued_requests:
            raise RPCError(OVERLOADED, f"server queue is full ({self.limits.max_queued_requests} requests)")
        if request.prompt is not None:
            self.check_prompt_bytes(request.prompt, "prompt")
        if request.request_id is None:
            request_id = f"req-{next(self._request_ids)}"
        else:   # the door's prefix keeps the client's ids apart from the generated ones and the HTTP door's
            request_id = f"{_CLIENT_ID_PREFIX}{request.request_id}"
            if request_id in self._pending:
                raise RPCError(INVALID_PARAMS, f"request_id {request.request_id!r} is already in use")
        pending = _Pending(request_id, conn, msgid, request.stream, request.params.logprobs is not None,
                           request.prompt if request.prompt is not None else request.prompt_token_ids,
                           time.monotonic())
        self._pending[request_id] = pending
        self._drained.clear()
        conn.inflight[msgid] = request_id
        if request.prompt is None or len(request.prompt) <= _INLINE_TOKENIZE_CHARS:
            token_ids = request.prompt_token_ids or self.engine.tokenizer.encode(request.prompt)
            self._submit(pending, request, token_ids)
            return
        self._start_task(conn, self._tokenize_then_submit(pending, request))

    async def _tokenize_then_submit(self, pending: _Pending, request):
        token_ids = await self._off_loop(self.engine.tokenizer.encode, request.prompt)
        if pending.request_id in self._pending:   # not aborted meanwhile
            self._submit(pending, request, token_ids)

    def _submit(self, pending: _Pending, request, token_ids: list[int]):
        """Checks that need the token ids, the key's quota, then the engine."""
        try:
            if request.prompt is None and max(token_ids) >= self.engine.tokenizer.vocab_size:
                raise RPCError(INVALID_PARAMS, f"prompt_token_ids must be < vocab_size "
                                               f"({self.engine.tokenizer.vocab_size})")
            if len(token_ids) > self.max_prompt_tokens:
                raise RPCError(PROMPT_TOO_LONG, f"prompt has {len(token_ids)} tokens; the limit is "
                                                f"{self.max_prompt_tokens}")
            if pending.conn.key is not None:
                quota = self.keys.quota(pending.conn.key)
                charge = len(token_ids) + request.params.n * request.params.max_tokens
                if quota.key.tpm is not None and charge > quota.key.tpm:
                    raise RPCError(INVALID_PARAMS, f"prompt tokens + max_tokens ({charge}) must be <= the key's "
                                                   f"tokens per minute ({quota.key.tpm})")
                wait = quota.admit(charge)
                if wait is not None:
                    raise RPCError(RATE_LIMITED, f"over the quota of key {quota.key.name!r}", retry_after_s=wait)
                pending.quota, pending.charged_tokens = quota, charge
        except RPCError as e:
            log.info("%s rejected: %s", pending.request_id, e)
            self._fail(pending, e)
            return
        request_id, conn = pending.request_id, pending.conn
        pending.prompt_tokens = len(token_ids)
        priority = conn.default_priority if request.priority is None else request.priority
        log.info("%s conn=%d msgid=%d prompt_tokens=%d max_tokens=%d stream=%s priority=%d", request_id, conn.id,
                 pending.msgid, len(token_ids), request.params.max_tokens, request.stream, priority)
        paused = conn.stalled   # its client is not reading: it starts paused

        def add():
            # stream=False: a request answered once, at its end, costs no output per step (on this thread and
            # on the loop); 32 such requests with maximal stop lists made a bystander's every step 4x slower.
            self.engine.add_request(request_id, token_ids, request.params, arrival_time=pending.received,
                                    priority=priority, stream=request.stream)
            if paused:
                self.engine.pause_request(request_id)
        self._worker.post_unless_error(add, lambda error: self._on_add_failed(request_id, error))

    def _on_add_failed(self, request_id: str, error: Exception):
        pending = self._pending.get(request_id)
        if pending is None:
            return
        if isinstance(error, ValueError):
            log.info("%s rejected by the engine: %s", request_id, error)
            self._fail(pending, RPCError(INVALID_PARAMS, str(error)))
        else:
            log.error("%s add_request failed: %r", request_id, error)
            self._fail(pending, _internal_error())

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

    def _tokenize(self, conn, msgid, params):
        text = single_param(params, "text", str)
        if len(text) > self.limits.max_tokenize_bytes // 4:   # a character is at most 4 bytes
            num_bytes = len(text.encode("utf-8", "surrogatepass"))
            if num_bytes > self.limits.max_tokenize_bytes:
                raise RPCError(INVALID_PARAMS, f"text must be at most {self.limits.max_tokenize_bytes} bytes, "
                                               f"got {num_bytes}")
        if len(text) <= _INLINE_TOKENIZE_CHARS:
            return self.engine.tokenizer.encode(text)
        return self._off_loop(self.engine.tokenizer.encode, text)

    def _detokenize(self, conn, msgid, params):
        token_ids = single_param(params, "token_ids", list)
        if len(token_ids) > self.limits.max_detokenize_tokens:
            raise RPCError(INVALID_PARAMS, f"token_ids must hold at most {self.limits.max_detokenize_tokens} "
                                           f"ids, got {len(token_ids)}")
        token_ids = token_id_list(token_ids, "token_ids", self.engine.tokenizer.vocab_size)
        if len(token_ids) <= _INLINE_DETOKENIZE_TOKENS:
            return self.engine.tokenizer.decode(token_ids)
        return self._off_loop(self.engine.tokenizer.decode, token_ids)

    async def _off_loop(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._text_pool, fn, *args)

    def check_prompt_bytes(self, text: str, name: str) -> None:
        """RPCError(PROMPT_TOO_LONG) for a text prompt of more bytes than max_prompt_tokens tokens can hold:
        refused before it is tokenized (a 900 KB prompt took 0.55 s to tokenize, only to be refused)."""
        if len(text) > self._max_prompt_bytes // 4:   # a character is at most 4 bytes
            num_bytes = len(text.encode("utf-8", "surrogatepass"))
            if num_bytes > self._max_prompt_bytes:
                raise RPCError(PROMPT_TOO_LONG, f"{name} has {num_bytes} bytes, more than the "
                                                f"{self.max_prompt_tokens} tokens allowed can hold")

    async def encode_prompt(self, text: str, name: str, add_special_tokens: bool = True) -> list[int]:
        """Another door's prompt text as token ids: its bytes checked first, a big one tokenized on the tokenizer
        thread (the msgpack door's generate does the same)."""
        self.check_prompt_bytes(text, name)
        if len(text) <= _INLINE_TOKENIZE_CHARS:
            return self.engine.tokenizer.encode(text, add_special_tokens)
        return await self._off_loop(self.engine.tokenizer.encode, text, add_special_tokens)

    def _model_info(self, conn, msgid, params) -> dict:
        config = self.engine.config
        return {"model": self._model_name, "vocab_size": self.engine.tokenizer.vocab_size,
                "max_model_len": self.engine.max_model_len, "eos_token_ids": list(self.engine.tokenizer.eos_token_ids),
                "scheduler": config.scheduler, "chunk_size": config.chunk_size, "block_size": config.block_size,
                "max_num_seqs": config.max_num_seqs, "device": config.device,
                "enable_prefix_caching": config.enable_prefix_caching,
                "tensor_parallel_size": config.tensor_parallel_size,
                "max_prompt_tokens": self.max_prompt_tokens, "max_tokens": self.limits.max_tokens}

    def _health(self, conn, msgid, params) -> dict:
        """"failed" (with the error) once the model cannot run any more (its tensor-parallel ranks died), so a
        load balancer's check takes the replica out."""
        if self.engine.model_failure is not None:
            return {"status": "failed", "error": str(self.engine.model_failure),
                    "uptime_s": time.monotonic() - self._started}
        return {"status": "shutting_down" if self._shutting_down else "ok",
                "uptime_s": time.monotonic() - self._started}

    async def _stats(self, conn, msgid, params) -> dict:
        """params [] or [{"steps_since": N}]: the latter adds `step_times`, the summary of the steps from step N
        (stats' `steps` counts them) on, at most the latest STEP_SUMMARY_MAX_STEPS."""
        since = None if not params else single_param(params, "steps_since", int)
        if since is not None and since < 0:
            raise RPCError(INVALID_PARAMS, f"steps_since must be >= 0, got {since}")

        def read():   # on the engine thread: the records only (a list of references); the summary is made here
            steps = self.engine.step_records
            return self.engine.stats(), None if since is None else steps[max(since, len(steps) - STEP_SUMMARY_MAX_STEPS):]
        engine_stats, records = await self._worker.call(read)
        if records is not None:
            engine_stats["step_times"] = step_time_summary(records)
        now = time.monotonic()
        self._trim_throughput_window(now)
        window = min(_THROUGHPUT_WINDOW_S, now - self._started)
        return {**engine_stats, **self.security_stats(),
                "connections": len(self._connections),
                "pending_requests": len(self._pending) + len(self._door_requests),
                "pending_calls": sum(c.pending_calls for c in self._connections),
                "write_buffer_bytes": sum(c.buffered() for c in self._connections if not c.closed),
                "throughput_tokens_per_s": sum(n for _, n in self._delivered) / max(window, 1e-9),
                "uptime_s": now - self._started}

    def security_stats(self) -> dict:
        """What `stats` and the metrics report about auth, quotas and paused requests (on the loop)."""
        stats = {"unauthenticated_connections": len(self._unauthenticated),
                 "auth_failures": self._throttle.failures_total,
                 **{name: self._counters[name] for name in ("paused", "resumed", "unread_aborts",
                                                             "unauthenticated_evicted")}}
        if self.keys is not None:
            stats["keys"] = {name: dict(quota.counters, inflight=quota.inflight)
                             for name, quota in self.keys.quotas.items()}
        return stats

    def _auth(self, conn, msgid, params) -> bool:
        secret = single_param(params, "api_key", str)
        if self.keys is None:
            return True
        key = self.keys.authenticate(secret)
        if key is None:
            self._revoke(conn)
            conn.auth_failures += 1
            conn.auth_delay = self._throttle.failed(conn.address)
            if conn.auth_failures >= _MAX_AUTH_FAILURES_PER_CONNECTION:
                conn.close(flush=True)
            raise RPCError(UNAUTHORIZED, "wrong API key")
        self._throttle.succeeded(conn.address)
        if not self._authenticated(conn, key):
            raise RPCError(OVERLOADED, f"more than {self.limits.max_connections} connections")
        conn.default_priority = key.priority
        return True

    _handlers = {"generate": _generate, "abort": _abort, "tokenize": _tokenize, "detokenize": _detokenize,
                 "model_info": _model_info, "health": _health, "stats": _stats, "auth": _auth}

    # ---------------------------------------------------------------- engine outputs (on the loop)

    def _on_outputs(self, outputs):
        now = time.monotonic()
        corked = set()   # each connection's messages of this step go out in one write (_Connection.cork)
        try:
            for output in outputs:
                pending = self._pending.get(output.request_id)
                if pending is None:
                    self._deliver_to_door(output)   # or aborted or failed while the engine was stepping
                    continue
                if pending.conn not in corked:
                    pending.conn.cork()
                    corked.add(pending.conn)
                try:
                    self._deliver(pending, output, now)
                except Exception:   # one bad output must not strand the others of this step
                    log.exception("%s delivering output failed", pending.request_id)
                    self._fail(pending, _internal_error())
                    self._worker.post(lambda rid=pending.request_id: self.engine.abort_request(rid))
        finally:
            for conn in corked:
                conn.uncork()
        self._trim_throughput_window(now)

    def _deliver(self, pending: _Pending, output, now: float):
        for completion in output.outputs:   # n > 1: every choice's chunks carry its index
            if completion.index == len(pending.sent):
                pending.sent.append((0, 0))
            sent_chars, sent_tokens = pending.sent[completion.index]
            piece = completion.text[sent_chars:]
            new_ids = list(completion.token_ids[sent_tokens:])
            if new_ids:
                if pending.first_token_time is None:   # unstreamed: reported once, at its end
                    pending.first_token_time = now if pending.stream else output.metrics.first_token_time
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
        # The engine's state is suspect after a failed step: fail everything it holds. A failed model (its
        # tensor-parallel ranks died) says so, in words written for clients; any other exception stays in the log.
        failure = self.engine.model_failure
        answer = _internal_error() if failure is None else RPCError(INTERNAL, f"engine step failed: {failure}")
        for pending in list(self._pending.values()):
            self._fail(pending, answer)
            self._worker.post(lambda rid=pending.request_id: self.engine.abort_request(rid))
        self._fail_door_requests(answer)

    def _fail(self, pending: _Pending, error: RPCError):
        self._forget(pending)
        pending.conn.respond(pending.msgid, error)
        self._close_if_drained(pending.conn)

    def _close_if_drained(self, conn: _Connection):
        if self._shutting_down and not conn.inflight:
            conn.close(flush=True)

    def _forget(self, pending: _Pending):
        if self._pending.pop(pending.request_id, None) is not None and pending.quota is not None:
            pending.quota.finish(pending.charged_tokens, pending.prompt_tokens, sum(t for _, t in pending.sent))
        pending.conn.inflight.pop(pending.msgid, None)
        self._check_drained()

    def report_finished(self, finished: FinishedRequest) -> None:
        """Either door, once per request: its log line, then the listeners (metrics)."""
        log_finished(finished)
        for listener in self.finish_listeners:
            listener(finished)

    def _report_aborted(self, pending: _Pending) -> None:
        self.report_finished(FinishedRequest(_public_id(pending.request_id), "msgpack", pending.conn.peer,
                                             pending.prompt, pending.prompt_tokens, 0, sum(t for _, t in pending.sent),
                                             "abort", None))

    # ---------------------------------------------------------------- the other doors' requests (on the loop)

    @property
    def accepting(self) -> bool:
        """False once shutdown began or the model failed (the HTTP door's /ready)."""
        return not self._leaving and self.engine.model_failure is None

    @property
    def tls(self) -> ssl.SSLContext | None:
        return self._tls

    def authenticate(self, secret: str | None, address: str) -> tuple[bool, Key | None, float]:
        """Another door's credentials: (accepted, the key or None without keys, seconds to wait before
        answering a refusal: the same per-address backoff as failed msgpack auths)."""
        if self.keys is None:
            return True, None, 0.0
        key = None if secret is None else self.keys.authenticate(secret)
        if key is None:
            return False, None, self._throttle.failed(address)
        self._throttle.succeeded(address)
        return True, key, 0.0

    def admit(self, key: Key | None, max_tokens: int, tokens: int) -> Quota | None:
        """Another door's request of `tokens` (prompts + max_tokens of every choice) against its key's
        quota; RPCError (invalid_params, rate_limited with retry_after_s) if it may not run. Returns the
        quota charged (None without a key), to pass to release() when the request ends."""
        if key is None:
            return None
        if key.max_tokens is not None and max_tokens > key.max_tokens:
            raise RPCError(INVALID_PARAMS, f"max_tokens must be <= {key.max_tokens} for this key, got {max_tokens}")
        quota = self.keys.quota(key)
        if key.tpm is not None and tokens > key.tpm:
            raise RPCError(INVALID_PARAMS, f"prompt tokens + max_tokens ({tokens}) must be <= the key's tokens per "
                                           f"minute ({key.tpm})")
        wait = quota.admit(tokens)
        if wait is not None:
            raise RPCError(RATE_LIMITED, f"over the quota of key {key.name!r}", retry_after_s=wait)
        return quota

    def engine_call(self, fn) -> asyncio.Future:
        """Run fn() on the engine thread between steps (e.g. engine.stats for a metrics scrape)."""
        return self._worker.call(fn)

    def submit(self, request_id: str, token_ids: list[int], params, on_output, arrival_time: float,
               priority: int | None = None, stream: bool = True) -> asyncio.Future:
        """Queue a request of another door under the same limits as `generate`. on_output is called on the loop
        with each of its RequestOutputs (the last one finished; stream=False: only that one), or once with an
        RPCError if it fails. priority: lower runs first; None: 0. Returns a future done once the engine took
        or refused it (refused: on_output already has the error)."""
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
                                                                  arrival_time=arrival_time, priority=priority,
                                                                  stream=stream))
        added.add_done_callback(lambda future: self._on_door_added(request_id, future))
        return added

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
            on_output(_internal_error())

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


def _internal_error() -> RPCError:
    # The exception goes to the server's log; the client learns nothing of the server's code.
    return RPCError(INTERNAL, "internal server error (logged on the server)")


def _longest_token_bytes(tokenizer) -> int:
    """An upper bound on the UTF-8 bytes of prompt text one token covers: 4x (NFKC normalization can fold
    a 4-byte character to 1 byte before tokenizing) the longest token's text, at least 4."""
    vocab = tokenizer.hf.get_vocab(with_added_tokens=True)
    longest = max((len(token.encode("utf-8")) for token in vocab), default=1)
    return 4 * max(longest, 1)


def _bound_kernel_buffer(writer: asyncio.StreamWriter):
    sock = writer.get_extra_info("socket")
    if sock is None:
        return
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCKET_SNDBUF)
        if sock.family in (socket.AF_INET, socket.AF_INET6) and hasattr(socket, "TCP_NOTSENT_LOWAT"):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT, _TCP_NOTSENT_LOWAT)
    except OSError:   # not every platform has both; the transport's own buffer is still bounded
        pass


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
        self._message_started: float | None = None   # when the unfinished message's first byte came
        self._message_at = 0                         # unpacker offset where that message starts
        self._unpacker: msgpack.Unpacker | None = None
        self.resize()

    def resize(self):
        """A fresh unpacker for the connection's state (called with no bytes pending, or on auth), keeping
        the bytes not yet unpacked: before auth they are at most 2 x max_unauthenticated_message_bytes,
        which _tail keeps (msgpack cannot hand back a half-read object)."""
        rest = b""
        if self._unpacker is not None and self._fed > self._consumed:
            rest = self._tail[len(self._tail) - (self._fed - self._consumed):]
        limit = (self._limits.max_message_bytes if self._conn.authenticated
                 else self._limits.max_unauthenticated_message_bytes)
        self.read_size = _READ_SIZE if self._conn.authenticated else _UNAUTHENTICATED_READ_SIZE
        self._unpacker = make_unpacker(limit)
        self._fed = 0
        self._consumed = 0   # bytes of whole messages unpacked (msgpack's tell() also counts a partial one)
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
            self._tail = (self._tail + data)[-2 * self._limits.max_unauthenticated_message_bytes:]
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
        except TypeError:   # a map key msgpack can decode but that cannot be a key here (an array, a map)
            raise _BadMessage(None, "a map key must be a string, a number, a bool or nil") from None
        except (msgpack.UnpackException, ValueError):
            raise _BadMessage(None, "bytes that are not msgpack") from None
        self._consumed = self._unpacker.tell()   # exact right after a whole object
        self._message_started = time.monotonic()   # the next message starts here
        self._message_at = self._consumed
        return message

    def done_with_data(self):
        """Every whole message is handled: the deadline now runs only if part of one is buffered."""
        if self._fed == self._consumed:
            self._message_started = None
            if self._grown:   # a big message made the buffer grow: give it back
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
        if self._message_started is not None and now >= self._message_started + self._limits.message_timeout_s:
            return f"a message took more than {self._limits.message_timeout_s:.0f}s to arrive"
        if not self._conn.inflight and not self._conn.pending_calls:
            return f"idle for {self._limits.idle_timeout_s:.0f}s"
        return None


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
