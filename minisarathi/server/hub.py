"""The serving hub: what every door shares. A door (msgpack_door.py, http.py) speaks one protocol and calls
into the hub, which owns the engine thread, admission, keys and quotas, the one registry of requests in
flight, drain, the request log and the security stats. No door imports another. Its API, on the event loop:

- `doors`: objects with `await start()` (-> addresses), `await stop_accepting()` (the drain began: close
  the listeners) and `await stop()` (every request answered or aborted); `accepting`, `shutting_down`.
- `await auth_turn(address)` before a credential is read (False: refuse it unchecked), then
  `authenticate(secret, address)` -> (accepted, key): the per-address backoff of gate.py; `precheck(key,
  max_tokens, tokens, requests)` refuses what the quota and the queue would refuse, before any tokenizing;
  `admit(key, max_tokens, tokens, requests)` charges the key's quota and returns it, for the door's one
  `quota.finish(...)`.
- `listen(sock, make_protocol)`: accept on a listening socket (gate.Listener); every connection counts in
  `pool` (gate.ConnectionPool) from accept on. A key reload revokes the connections whose key is gone.
- `check_prompt_bytes`, `encode_prompt`; `encode`/`decode` answer small texts at once and return a
  coroutine (on the tokenizer thread) for big ones.
- `open(request_id, on_output)` registers a request (its id not `in_use`), `submit(...)` hands it to the
  engine, `cancel(request_id, on_aborted)` aborts it (on_aborted(tokens it generated) once the engine let go),
  `pause(request_ids, paused)`. on_output gets each RequestOutput (the last one finished) or one RPCError
  (an EngineRefused: nothing of it ran); the id is free again after either.
- `report_finished(FinishedRequest)` once per request, `engine_call(fn)`, `security_stats()`.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import os
import signal
import socket
import ssl
import sys
import threading
import time
from typing import Callable

from minisarathi.server.auth import Key, KeyStore, Quota
from minisarathi.server.engine_worker import EngineWorker
from minisarathi.server.gate import AuthGate, ConnectionPool, Listener, RateLimitedLog
from minisarathi.server.protocol import (
    ABORTED,
    INTERNAL,
    INVALID_PARAMS,
    OVERLOADED,
    PROMPT_TOO_LONG,
    RATE_LIMITED,
    UNAUTHORIZED,
    RPCError,
    ServerLimits,
)
from minisarathi.server.request_log import FinishedRequest, log_finished

log = logging.getLogger("minisarathi.server")

# Text longer than this is tokenized on the tokenizer thread (tokenizers releases the GIL), so the loop is
# held only briefly; the same for detokenizing more ids.
# Unsent output (the transport's buffer) past which a connection's client has stopped reading: its requests
# are paused (and, on the msgpack door, no more are read).
UNREAD_HIGH_WATER = 1 << 16
# The kernel's share of unread output, bounded too: with autotuning a loopback socket buffers megabytes,
# enough to hide hundreds of unread streams from the check above. Linux doubles SO_SNDBUF.
_SOCKET_SNDBUF = 32 << 10
_TCP_NOTSENT_LOWAT = 16 << 10
_INLINE_TOKENIZE_CHARS = 4096
_INLINE_DETOKENIZE_TOKENS = 4096
# Big tokenize/detokenize calls are bulk work for one client: the tokenizer thread runs them this much nicer
# than the rest of the server, so when the cores are short the engine's steps (every client's tokens), the
# event loop and the small calls it answers inline go first.
TOKENIZER_NICE_INCREMENT = 10


class ListenError(OSError):
    """A listener could not be opened; `listener` says which: "tcp", "unix", or the door (in Hub.doors)."""

    def __init__(self, listener, error: OSError):
        super().__init__(error.errno, error.strerror or str(error))
        self.listener = listener


def internal_error() -> RPCError:
    # The exception goes to the server's log; the client learns nothing of the server's code.
    return RPCError(INTERNAL, "internal server error (logged on the server)")


class EngineRefused(RPCError):
    """The engine refused a request when it was added (e.g. a logit_bias id past the vocabulary): nothing of
    it ran, so its quota gets everything back."""


class Hub:
    def __init__(
        self,
        engine,
        limits: ServerLimits | None = None,
        keys: KeyStore | None = None,
        model_name: str = "",
        tls: ssl.SSLContext | None = None,
        proxies=None,
    ):
        self.engine = engine
        self.limits = limits or ServerLimits()
        self.keys = keys  # None: no auth
        self.model_name = model_name  # the model folder's name, never its path
        self.tls, self.proxies = tls, proxies  # the listeners' SSLContext, proxy_protocol.TrustedProxies
        self.doors: list = []
        self.finish_listeners: list[Callable[[FinishedRequest], None]] = []  # called by report_finished
        self.pool = ConnectionPool(self.limits, keys is not None)  # the doors' connections (gate.py)
        self.counters = collections.Counter()  # paused, resumed, unread_aborts
        self.started = time.monotonic()
        self.shutting_down = False  # requests are refused (drain_delay_s after the drain began)
        self._leaving = False  # the drain began: /ready answers 503
        self._requests: dict[str, Callable] = {}  # engine request id -> its door's on_output
        # cancelled requests the engine has not let go of yet -> tokens of an output that arrived meanwhile
        self._cancelling: dict[str, int] = {}
        self._worker: EngineWorker | None = None
        self._drained: asyncio.Event | None = None  # set whenever no request is registered
        # One thread for big tokenize/detokenize work: off the loop, and one at a time, so a flood of them
        # queues (holding only its inputs) instead of taking every core; at a lower CPU priority. Small calls
        # (the bystander's) are answered on the loop, never queued behind big ones.
        self._text_pool = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="tokenizer", initializer=_lower_thread_priority
        )
        self._gate = AuthGate()
        self._listeners: list[Listener] = []
        self.refused_log = RateLimitedLog(log)  # connections refused: one line per interval
        self.max_prompt_tokens = min(self.limits.max_prompt_tokens, engine.max_model_len)
        # A prompt of more bytes than this has more tokens than any limit allows, whatever its text.
        self.max_prompt_bytes = self.max_prompt_tokens * _longest_token_bytes(engine.tokenizer)

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> list[str]:
        """Start the engine thread, then every door; returns their addresses. A listener that cannot be
        opened raises ListenError, which says which one."""
        self._drained = asyncio.Event()
        self._drained.set()
        self._worker = EngineWorker(
            self.engine, asyncio.get_running_loop(), self._on_outputs, self._on_step_error
        )
        self._worker.start()
        addresses = []
        for door in self.doors:
            try:
                addresses += await door.start()
            except ListenError:
                raise
            except OSError as e:
                raise ListenError(door, e) from None
        return addresses

    async def shutdown(self):
        """Stop accepting, give in-flight requests the grace period, abort the rest, close everything.

        The listeners close first, so a load balancer's next connection (or TCP health check) fails and goes
        to another replica; each door then closes its connections as they fall idle (docs/deploy.md). With a
        drain delay, /ready first answers 503 while everything else is served as before, long enough for a
        balancer's health checks to take the replica out: no request of its then meets a refusal that it
        would have to retry."""
        self._leaving = True
        if self.limits.drain_delay_s > 0:
            log.info(
                "shutting down: /ready answers 503; serving on for %.1fs first", self.limits.drain_delay_s
            )
            await asyncio.sleep(self.limits.drain_delay_s)
        self.shutting_down = True
        for door in self.doors:
            await door.stop_accepting()
        if self._requests:
            log.info(
                "shutting down: waiting up to %.1fs for %d requests",
                self.limits.shutdown_grace_s,
                len(self._requests),
            )
            try:
                await asyncio.wait_for(self._drained.wait(), self.limits.shutdown_grace_s)
            except asyncio.TimeoutError:
                pass
        self._fail_all(RPCError(ABORTED, "server shutting down"))
        for door in self.doors:
            await door.stop()
        await asyncio.get_running_loop().run_in_executor(None, self._worker.stop)
        self._text_pool.shutdown(cancel_futures=True)
        log.info("server stopped")

    async def run(self):
        """Serve until SIGINT or SIGTERM, then shut down; prints one 'serving on' line per address.
        SIGHUP reloads the keys file."""
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        # before the addresses are printed: a supervisor may signal then
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        loop.add_signal_handler(signal.SIGHUP, self.reload_keys)
        addresses = await self.start()
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

    @property
    def accepting(self) -> bool:
        """False once shutdown began or the model failed (the HTTP door's /ready)."""
        return not self._leaving and self.engine.model_failure is None

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
        for conn in list(self.pool.connections):
            if conn.key is not None:
                key = self.keys.current(conn.key)
                if key is None:
                    self.pool.revoke(conn)
                conn.key = key
        log.info("keys reloaded from %s", self.keys.path)

    # ---------------------------------------------------------------- keys and quotas

    async def auth_turn(self, address: str) -> bool:
        """Wait for the address's turn to have a credential checked (at once unless it failed recently);
        False: it queued too many, refuse the attempt unchecked."""
        return self.keys is None or await self._gate.turn(address)

    def backoff_wait_s(self, address: str) -> float:
        """Seconds until the address's next credential check may run (0 without keys or recent failures)."""
        return 0.0 if self.keys is None else self._gate.wait_s(address)

    def authenticate(self, secret: str | None, address: str) -> tuple[bool, Key | None]:
        """(accepted, the key or None without keys); a refusal spaces the address's next checks further."""
        if self.keys is None:
            return True, None
        key = None if secret is None else self.keys.authenticate(secret)
        if key is None:
            self._gate.failed(address)
            return False, None
        return True, key

    @staticmethod
    def check_max_tokens(key: Key | None, max_tokens: int) -> None:
        """RPCError(INVALID_PARAMS) if the key caps max_tokens below the request's."""
        if key is not None and key.max_tokens is not None and max_tokens > key.max_tokens:
            raise RPCError(
                INVALID_PARAMS, f"max_tokens must be <= {key.max_tokens} for this key, got {max_tokens}"
            )

    def precheck(self, key: Key | None, max_tokens: int, tokens: int, requests: int, queued: int) -> None:
        """Before a request's prompts are tokenized: RPCError if the queue would refuse `queued` engine
        requests (one per prompt) or the key's quota `requests` (prompts x n) of at least `tokens` (the
        token-id prompts, a token per text prompt, max_tokens of every choice): a refused flood costs no
        tokenizing."""
        if self.shutting_down:
            raise RPCError(OVERLOADED, "server is shutting down")
        if len(self._requests) + queued > self.limits.max_queued_requests:
            raise RPCError(OVERLOADED, f"server queue is full ({self.limits.max_queued_requests} requests)")
        if key is not None:
            quota = self._quota_for(key, max_tokens, tokens, requests)
            wait = quota.wait_s(tokens, requests)
            if wait > 0:
                quota.counters["rate_limited"] += 1
                raise RPCError(RATE_LIMITED, f"over the quota of key {key.name!r}", retry_after_s=wait)

    def admit(self, key: Key | None, max_tokens: int, tokens: int, requests: int = 1) -> Quota | None:
        """`requests` engine requests (an HTTP request's prompts x n; a msgpack generate's n) of `tokens` in
        all (prompts + max_tokens of every choice) against the key's quota; RPCError (invalid_params,
        rate_limited with retry_after_s) if they may not run. Returns the quota charged (None without a
        key), whose finish() the door calls when the request ends."""
        if key is None:
            return None
        quota = self._quota_for(key, max_tokens, tokens, requests)
        wait = quota.admit(tokens, requests)
        if wait is not None:
            raise RPCError(RATE_LIMITED, f"over the quota of key {key.name!r}", retry_after_s=wait)
        return quota

    def _quota_for(self, key: Key, max_tokens: int, tokens: int, requests: int) -> Quota:
        """The key's quota; RPCError(INVALID_PARAMS) for a request it could never admit, UNAUTHORIZED for a
        key a reload removed while the request arrived."""
        key = self.keys.current(key)
        if key is None:
            raise RPCError(UNAUTHORIZED, "the API key was revoked")
        self.check_max_tokens(key, max_tokens)
        if key.tpm is not None and tokens > key.tpm:
            raise RPCError(
                INVALID_PARAMS,
                f"prompt tokens + max_tokens ({tokens}) must be <= the key's tokens per minute ({key.tpm})",
            )
        for limit, what in ((key.rpm, "requests per minute"), (key.concurrent, "concurrent requests")):
            if limit is not None and requests > limit:
                raise RPCError(
                    INVALID_PARAMS,
                    f"this request counts as {requests} requests (prompts x n), more than the key's "
                    f"{what} ({limit})",
                )
        return self.keys.quota(key)

    def listen(self, sock: socket.socket, make_protocol) -> None:
        """Serve a listening socket: make_protocol(arrival) makes each connection's protocol, which hands
        the arrival back with pool.disconnect() before it connects its own connection."""
        listener = Listener(self, sock, make_protocol, self.tls, self.proxies)
        self._listeners.append(listener)
        listener.start()

    def stop_listening(self, sock: socket.socket) -> None:
        for listener in [lst for lst in self._listeners if lst.sock is sock]:
            listener.close()
            self._listeners.remove(listener)

    # ---------------------------------------------------------------- prompts and text

    def check_prompt_bytes(self, text: str, name: str) -> None:
        """RPCError(PROMPT_TOO_LONG) for a text prompt of more bytes than max_prompt_tokens tokens can hold:
        refused before the tokenizer spends time on it."""
        if len(text) > self.max_prompt_bytes // 4:  # a character is at most 4 bytes
            num_bytes = len(text.encode("utf-8", "surrogatepass"))
            if num_bytes > self.max_prompt_bytes:
                raise RPCError(
                    PROMPT_TOO_LONG,
                    f"{name} has {num_bytes} bytes, more than the "
                    f"{self.max_prompt_tokens} tokens allowed can hold",
                )

    async def encode_prompt(self, text: str, name: str, add_special_tokens: bool = True) -> list[int]:
        """A prompt text as token ids: its bytes checked first, a big one tokenized on the tokenizer
        thread."""
        self.check_prompt_bytes(text, name)
        token_ids = self.encode(text, add_special_tokens)
        return token_ids if isinstance(token_ids, list) else await token_ids

    def encode(self, text: str, add_special_tokens: bool = True):
        """The token ids of a short text, or a coroutine that tokenizes a long one on the tokenizer thread."""
        if len(text) <= _INLINE_TOKENIZE_CHARS:
            return self.engine.tokenizer.encode(text, add_special_tokens)
        return self._off_loop(self.engine.tokenizer.encode, text, add_special_tokens)

    def decode(self, token_ids: list[int]):
        """The text of a few token ids, or a coroutine that detokenizes many on the tokenizer thread."""
        if len(token_ids) <= _INLINE_DETOKENIZE_TOKENS:
            return self.engine.tokenizer.decode(token_ids)
        return self._off_loop(self.engine.tokenizer.decode, token_ids)

    async def _off_loop(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._text_pool, fn, *args)

    # ---------------------------------------------------------------- requests

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def in_use(self, request_id: str) -> bool:
        return request_id in self._requests or request_id in self._cancelling

    def open(self, request_id: str, on_output: Callable) -> None:
        """Register a request (its id not in_use) under the server's limits; RPCError(OVERLOADED) if it may
        not. From now on drain waits for it."""
        self.precheck(None, 0, 0, 0, queued=1)  # the queue's checks: room for one more, not shutting down
        self._requests[request_id] = on_output
        self._drained.clear()

    def submit(
        self,
        request_id: str,
        token_ids: list[int],
        params,
        arrival_time: float,
        priority: int = 0,
        stream: bool = True,
        paused: bool = False,
        confirm: bool = False,
    ) -> asyncio.Future | None:
        """Hand an open request to the engine. priority: lower runs first; stream=False: on_output gets only
        the last output; paused: it starts paused. If the engine refuses it, on_output gets the error.
        confirm: returns a future done once the engine took or refused it; without, success costs the loop
        nothing (no wake-up from the engine thread)."""

        def add():
            # stream=False: a request answered once, at its end, costs no output per step (on the engine
            # thread and on the loop).
            self.engine.add_request(
                request_id, token_ids, params, arrival_time=arrival_time, priority=priority, stream=stream
            )
            if paused:
                self.engine.pause_request(request_id)

        if not confirm:
            self._worker.post_unless_error(add, lambda error: self._refused(request_id, error))
            return None
        added = self._worker.call(add)

        def taken(future):
            if future.exception() is not None:
                self._refused(request_id, future.exception())

        added.add_done_callback(taken)
        return added

    def cancel(self, request_id: str, on_aborted: Callable[[int], None] | None = None) -> None:
        """Abort a request (its client went away or asked); its outputs are no longer delivered.
        on_aborted(tokens its choices generated) is called on the loop once the engine let go of it (at
        once, with 0, for a request not registered), so that a quota is refunded only what was not
        generated, delivered or not."""
        if self._requests.pop(request_id, None) is None:
            if on_aborted is not None:
                on_aborted(0)
            return
        self._check_drained()
        if on_aborted is None:
            self._worker.post(lambda: self.engine.abort_request(request_id))
            return
        self._cancelling[request_id] = 0
        aborted = self._worker.call(lambda: self.engine.abort_request(request_id))

        def settled(future):
            # outputs the engine sent before it let go were delivered first (one FIFO to the loop); a
            # request that finished meanwhile is no longer the engine's, and its last output counts
            seen = self._cancelling.pop(request_id, 0)
            generated = None if future.exception() is not None else future.result()
            on_aborted(max(generated or 0, seen))

        aborted.add_done_callback(settled)

    def pause(self, request_ids: list[str], paused: bool) -> None:
        """Stop scheduling the requests (their batch slots go to others), or go on with them."""
        if not request_ids:
            return
        self.counters["paused" if paused else "resumed"] += len(request_ids)
        hook = self.engine.pause_request if paused else self.engine.resume_request

        def apply():
            for request_id in request_ids:
                hook(request_id)

        self._worker.post(apply)

    def engine_call(self, fn) -> asyncio.Future:
        """Run fn() on the engine thread between steps (e.g. engine.stats for a metrics scrape)."""
        return self._worker.call(fn)

    def _refused(self, request_id: str, error: Exception):
        on_output = self._requests.pop(request_id, None)
        if on_output is None:  # cancelled meanwhile
            return
        self._check_drained()
        if isinstance(error, ValueError):
            log.info("%s rejected by the engine: %s", request_id, error)
            on_output(EngineRefused(INVALID_PARAMS, str(error)))
        else:
            log.error("%s add_request failed: %r", request_id, error)
            on_output(EngineRefused(INTERNAL, internal_error().message))

    def _on_outputs(self, outputs):
        for output in outputs:
            on_output = self._requests.get(output.request_id)
            if on_output is None:  # cancelled or failed while the engine was stepping
                if output.request_id in self._cancelling:
                    self._cancelling[output.request_id] = sum(len(c.token_ids) for c in output.outputs)
                continue
            if output.finished:
                del self._requests[output.request_id]
                self._check_drained()
            try:
                on_output(output)
            except Exception:  # one bad output must not strand the others of this step
                log.exception("%s delivering output failed", output.request_id)
                self._fail(output.request_id, on_output, internal_error())

    def _on_step_error(self, error: Exception):
        # The engine's state is suspect after a failed step: fail everything it holds. A failed model (its
        # tensor-parallel ranks died) says so, in words written for clients; other exceptions stay in the log.
        failure = self.engine.model_failure
        self._fail_all(
            internal_error() if failure is None else RPCError(INTERNAL, f"engine step failed: {failure}")
        )

    def _fail_all(self, error: RPCError):
        for request_id, on_output in list(self._requests.items()):
            self._fail(request_id, on_output, error)

    def _fail(self, request_id: str, on_output: Callable, error: RPCError):
        self._requests.pop(request_id, None)
        self._worker.post(lambda: self.engine.abort_request(request_id))
        self._check_drained()
        on_output(error)

    def _check_drained(self):
        if not self._requests:
            self._drained.set()

    # ---------------------------------------------------------------- reporting

    def report_finished(self, finished: FinishedRequest) -> None:
        """Every door, once per request: its log line, then the listeners (metrics)."""
        log_finished(finished)
        for listener in self.finish_listeners:
            listener(finished)

    def security_stats(self) -> dict:
        """What `stats` and the metrics report about auth, quotas and paused requests (on the loop)."""
        stats = {
            "unauthenticated_connections": len(self.pool.unauthenticated),
            "unauthenticated_evicted": self.pool.evicted,
            "auth_failures": self._gate.failures_total,
            **{name: self.counters[name] for name in ("paused", "resumed", "unread_aborts")},
        }
        if self.keys is not None:
            stats["keys"] = {
                name: dict(quota.counters, inflight=quota.inflight)
                for name, quota in self.keys.quotas.items()
            }
        return stats


def bound_kernel_buffer(sock: socket.socket | None) -> None:
    """A connection's kernel send buffer kept small, so that unread output shows in its transport's buffer."""
    if sock is None:
        return
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCKET_SNDBUF)
        if sock.family in (socket.AF_INET, socket.AF_INET6) and hasattr(socket, "TCP_NOTSENT_LOWAT"):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT, _TCP_NOTSENT_LOWAT)
    except OSError:  # not every platform has both; the transport's own buffer is still bounded
        pass


def _lower_thread_priority() -> None:
    """The calling thread's nice value raised by TOKENIZER_NICE_INCREMENT (Linux sets it per thread; elsewhere
    it would apply to the whole process, so it is left alone there)."""
    if sys.platform.startswith("linux"):
        thread = threading.get_native_id()
        try:
            os.setpriority(
                os.PRIO_PROCESS,
                thread,
                min(19, os.getpriority(os.PRIO_PROCESS, thread) + TOKENIZER_NICE_INCREMENT),
            )
        except OSError as e:  # e.g. a seccomp profile: the thread pool must still work (an initializer that
            log.warning("the tokenizer thread keeps its priority: %s", e)  # raises breaks it for good)


def _longest_token_bytes(tokenizer) -> int:
    """An upper bound on the UTF-8 bytes of prompt text one token covers: 4x (NFKC normalization can fold
    a 4-byte character to 1 byte before tokenizing) the longest token's text, at least 4."""
    vocab = tokenizer.hf.get_vocab(with_added_tokens=True)
    longest = max((len(token.encode("utf-8")) for token in vocab), default=1)
    return 4 * max(longest, 1)
