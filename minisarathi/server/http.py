"""The OpenAI-compatible HTTP door: aiohttp on the server's event loop, the same engine thread, limits, API
key and metrics as the msgpack door, all the Hub's (aiohttp because it is asyncio-native: it runs on the
hub's loop, with no second thread or event loop, and it streams responses with backpressure).

Endpoints: POST /v1/completions, POST /v1/chat/completions, POST /v1/messages (Anthropic's: anthropic_api),
POST /v1/embeddings (server/embeddings.py), GET /v1/models (the key is required on /v1/ when one is
configured), GET /health, GET /ready, GET /metrics (open, as probes and scrapers expect).
A request's choices are engine requests whose outputs the hub hands to this door on the loop; a
client that goes away (aiohttp cancels its handler) has them aborted, which frees their KV blocks.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import math
import re
import socket
import sys
import time
import uuid
from dataclasses import dataclass, field

from aiohttp import web

from minisarathi.outputs import RequestOutput
from minisarathi.server import anthropic_api, embeddings
from minisarathi.server.auth import Key, Quota
from minisarathi.server.chat_template import ChatTemplate, ChatTemplateError, TemplateWorker
from minisarathi.server.gate import Arrival, RateLimitedLog, bind, client_address
from minisarathi.server.hub import UNREAD_HIGH_WATER, EngineRefused, Hub, bound_kernel_buffer
from minisarathi.server.metrics import CONTENT_TYPE, Metrics
from minisarathi.server.openai_api import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    DoorLimits,
    GenerationRequest,
    OpenAIError,
    chat_logprobs,
    check_prompt_length,
    completion_logprobs,
    finish_reason,
    parse_chat,
    parse_completion,
    usage,
)
from minisarathi.server.protocol import (
    ABORTED,
    INVALID_PARAMS,
    OVERLOADED,
    OVERLOADED_RETRY_S,
    RATE_LIMITED,
    UNAUTHORIZED,
    RPCError,
    short,
)
from minisarathi.server.request_log import REQUEST_ID_RULE, FinishedRequest, valid_request_id
from minisarathi.server.tool_calls import ToolFormat, ToolStream, tool_message

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # a prefilter: most bodies have none
log = logging.getLogger("minisarathi.http")

REQUEST_ID_HEADER = "X-Request-Id"
_UNAUTHORIZED_MESSAGE = "a valid API key is required: Authorization: Bearer KEY"
_OPEN_PATHS = ("/health", "/ready", "/metrics")
REQUEST_FIELDS = COMPLETION_FIELDS | CHAT_FIELDS


@dataclass
class _Delta:
    """What one engine output added to a choice: one stream chunk, as the msgpack door sends one per
    output."""

    text: str
    token_ids: list[int]
    logprobs: list | None  # the new tokens' positions (dicts of Logprob), when asked for
    text_offset: int  # characters of the choice's text before this piece
    finish_reason: str | None


@dataclass
class _Choice:
    index: int
    prompt: int  # index of its prompt
    slot: int  # its place in its engine request's outputs (n > 1: the choices)
    engine_id: str  # of its prompt's engine request
    stream: bool
    output: RequestOutput | None = None  # the latest of its engine request (cumulative snapshots)
    error: RPCError | None = None
    deltas: collections.deque = field(default_factory=collections.deque)  # of _Delta, not yet written
    seen_chars: int = 0
    seen_tokens: int = 0
    started: bool = False  # chat streams: the role delta was sent
    ended: bool = False  # its last delta (with the finish reason) is queued
    tools: ToolStream | None = None  # a chat stream with tools: its tool-call parser
    error_sent: bool = False

    @property
    def done(self) -> bool:
        return self.error is not None or (self.output is not None and self.output.finished)

    def receive(self, output: RequestOutput | RPCError) -> None:
        if isinstance(output, RPCError):
            self.error = output
            return
        self.output = output
        completion = output.outputs[self.slot]
        if not self.stream or self.ended:
            return
        self.ended = completion.finish_reason is not None
        reason = finish_reason(completion)
        piece, new_ids = completion.text[self.seen_chars :], completion.token_ids[self.seen_tokens :]
        if piece or new_ids or reason:
            logprobs = None if completion.logprobs is None else completion.logprobs[self.seen_tokens :]
            self.deltas.append(_Delta(piece, new_ids, logprobs, self.seen_chars, reason))
        self.seen_chars, self.seen_tokens = len(completion.text), len(completion.token_ids)


class _QuietErrors(logging.Filter):
    """aiohttp's own log of malformed requests (a bad header, a bad method): one line per interval, no
    traceback; a flood of them would otherwise write one traceback each."""

    def __init__(self):
        super().__init__()
        self._log = RateLimitedLog(log, logging.INFO)

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        self._log("%s: %s", record.getMessage(), short(repr(error)) if error is not None else "")
        return False


_AIOHTTP_LOG = logging.getLogger("minisarathi.http.aiohttp")
_AIOHTTP_LOG.addFilter(_QuietErrors())


class _Connection(asyncio.Protocol):
    """One HTTP connection, around aiohttp's handler (which gets every event as it would from the
    transport): counted by the hub like a msgpack connection, unauthenticated until one of its requests
    brings a valid key, with the msgpack door's deadlines. Closed when it has not authenticated within
    auth_timeout_s of connecting, when a request's headers take longer than message_timeout_s from their
    first byte (its body: _json), or when it sends nothing for idle_timeout_s with no request running."""

    def __init__(self, door: HttpDoor, handler: asyncio.Protocol, arrival: Arrival):
        self.door, self.handler, self.arrival = door, handler, arrival
        self.address, self.peer, self.ip = arrival.address, arrival.peer, arrival.ip  # a proxy's header's
        self.authenticated = door.hub.keys is None
        self.key: Key | None = None
        self.opened = time.monotonic()
        self.closed = False
        self.active = 0  # requests being handled
        self.last_byte = self.opened
        self.message_started: float | None = None  # first byte of a request not yet handled
        self.transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        hub = self.door.hub
        self.transport = transport
        refused = hub.pool.hand_over(self.arrival, self)
        if refused is not None:
            hub.refused_log("connection from %s refused: %s", self.peer, refused)
            self.closed = True
            transport.abort()
            return
        self.door.connections[transport] = self
        self.handler.connection_made(transport)
        self.watch()

    def data_received(self, data: bytes) -> None:
        self.last_byte = time.monotonic()
        if not self.active and self.message_started is None:
            self.message_started = self.last_byte
        self.handler.data_received(data)

    def eof_received(self):
        return self.handler.eof_received()

    def pause_writing(self) -> None:
        self.handler.pause_writing()

    def resume_writing(self) -> None:
        self.handler.resume_writing()

    def connection_lost(self, exc) -> None:
        was_served = self.door.connections.pop(self.transport, None) is self
        self.closed = True
        if self._timer is not None:
            self._timer.cancel()
        self.door.hub.pool.disconnect(self)
        if was_served:
            self.handler.connection_lost(exc)

    def close(self) -> None:
        """Evicted (the hub's limits) or out of time."""
        if not self.closed and self.transport is not None:
            self.closed = True
            self.transport.abort()

    def request_started(self) -> None:
        self.active += 1
        self.message_started = None

    def request_ended(self) -> None:
        self.active -= 1
        self.last_byte = time.monotonic()
        self.watch()

    def watch(self) -> None:
        """Check the deadlines at the next one."""
        if self._timer is not None:
            self._timer.cancel()
        if not self.closed:
            wait = self._next_deadline() - time.monotonic()
            self._timer = asyncio.get_running_loop().call_later(max(wait, 0.0), self._check)

    def _deadlines(self) -> list[tuple[float, str]]:
        limits = self.door.hub.limits
        deadlines = []
        if not self.authenticated:
            deadlines.append(
                (self.opened + limits.auth_timeout_s, f"no valid key within {limits.auth_timeout_s:.0f}s")
            )
        if not self.active:
            deadlines.append(
                (self.last_byte + limits.idle_timeout_s, f"idle for {limits.idle_timeout_s:.0f}s")
            )
            if self.message_started is not None:
                deadlines.append(
                    (
                        self.message_started + limits.message_timeout_s,
                        f"a request took more than {limits.message_timeout_s:.0f}s to arrive",
                    )
                )
        return deadlines

    def _next_deadline(self) -> float:
        return min(
            (at for at, _ in self._deadlines()),
            default=time.monotonic() + self.door.hub.limits.idle_timeout_s,
        )

    def _check(self) -> None:
        self._timer = None
        now = time.monotonic()
        why = next((why for at, why in self._deadlines() if at <= now), None)
        if why is not None:
            log.debug("connection from %s closed: %s", self.peer, why)
            self.close()
        else:
            self.watch()


@dataclass
class _Call:
    """One HTTP generation request while it runs."""

    request_id: str
    kind: str  # "completion" | "chat" | "messages" (Anthropic's)
    request: GenerationRequest
    client: str
    received: float
    key: Key | None = None  # the API key it came with (None without keys)
    quota: Quota | None = None  # charged charged_tokens at admission; refunded at the end
    charged_tokens: int = 0
    created: int = field(default_factory=lambda: int(time.time()))
    choices: list[_Choice] = field(default_factory=list)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    added: list[asyncio.Future] = field(
        default_factory=list
    )  # per prompt: done once the engine took or refused it


class HttpDoor:
    def __init__(
        self,
        hub: Hub,
        host: str,
        port: int,
        model_name: str,
        chat_template: ChatTemplate | None,
        metrics: Metrics | None,
        serve_api: bool = True,
        tool_format: ToolFormat | None = None,
    ):
        """serve_api=False: only /health, /ready and /metrics (`--metrics-port` with the msgpack door
        alone). tool_format: the model's tool-call format (None: tools are refused)."""
        self.hub = hub
        self.host, self.port = host, port
        self.model_name = model_name
        self.templates = (
            None
            if chat_template is None
            else TemplateWorker(chat_template, hub.limits.template_timeout_s, hub.max_prompt_bytes)
        )
        self.metrics = metrics
        self.limits = DoorLimits(
            hub.max_prompt_tokens,
            hub.limits.max_tokens,
            hub.limits.max_n,
            hub.engine.tokenizer.vocab_size,
            hub.limits,
        )
        self.serve_api = serve_api
        self.tool_format = tool_format
        self._runner: web.AppRunner | None = None
        self._socks: list = []  # listening
        self.connections: dict[asyncio.BaseTransport, _Connection] = {}  # by transport, for the handlers
        self._created = int(time.time())
        app = web.Application(client_max_size=hub.limits.max_message_bytes, middlewares=[self._middleware])
        routes = [web.get("/health", self._health), web.get("/ready", self._ready)]
        if metrics is not None:
            routes.append(web.get("/metrics", self._metrics))
        if serve_api:
            routes += [
                web.post("/v1/completions", self._completions),
                web.post("/v1/chat/completions", self._chat),
                web.post("/v1/messages", self._messages),
                web.post("/v1/embeddings", self._embeddings),
                web.get("/v1/models", self._models),
                web.get("/v1/models/{model}", self._model),
            ]
        app.add_routes(routes)
        self.app = app

    async def start(self) -> list[str]:
        if self.templates is not None:
            await self.templates.start()
        # handler_cancellation: a client that disconnects cancels its handler, which aborts its requests.
        # The hub accepts the connections (counted from accept on, the TLS handshake under its deadline);
        # aiohttp's handler serves each, logging to a logger that keeps a flood of bad requests quiet.
        self._runner = web.AppRunner(
            self.app, handler_cancellation=True, access_log=None, logger=_AIOHTTP_LOG
        )
        await self._runner.setup()
        # (an OSError becomes the hub's ListenError naming this door)
        self._socks = bind(self.host, self.port, min(self.hub.limits.max_connections, socket.SOMAXCONN))
        for sock in self._socks:
            self.hub.listen(sock, self._protocol)
        scheme = "http" if self.hub.tls is None else "https"
        return [f"{scheme}://{s.getsockname()[0]}:{s.getsockname()[1]}" for s in self._socks]

    def _protocol(self, arrival: Arrival) -> _Connection:
        return _Connection(self, self._runner.server(), arrival)

    async def stop_accepting(self) -> None:
        """Draining: the API door closes its listener, so a load balancer's next connection to it is refused
        and goes to another replica (nginx retries a refused connection, even a POST; a request it already
        sent would not be); requests in flight go on. A probe-only door keeps answering, /ready with 503."""
        if self.serve_api:
            self._stop_listening()

    async def stop(self) -> None:
        self._stop_listening()
        if self.templates is not None:
            await self.templates.close()
        if self._runner is not None:
            await self._runner.cleanup()

    def _stop_listening(self) -> None:
        for sock in self._socks:
            self.hub.stop_listening(sock)
        self._socks = []

    # ------------------------------------------------------------------------------------------ plumbing

    @web.middleware
    async def _middleware(self, request: web.Request, handler):
        conn = self.connections.get(request.transport)
        if conn is not None:
            conn.request_started()
        # Anthropic's error shape on its path, OpenAI's elsewhere
        error_response = anthropic_api.error_response if request.path == "/v1/messages" else _error_response
        try:
            if request.path.startswith("/v1/"):
                await self._authenticate(request, conn)
            return await handler(request)
        except OpenAIError as e:
            response = error_response(e)
            if e.status == 408:  # the rest of a body that is late is not waited for
                response.force_close()
            if "request_id" in request:  # the id is known once the handler read it
                response.headers[REQUEST_ID_HEADER] = request["request_id"]
            return response
        except web.HTTPRequestEntityTooLarge:
            return error_response(
                OpenAIError(
                    413,
                    f"the request body exceeds {self.hub.limits.max_message_bytes} bytes",
                    code="request_too_large",
                )
            )
        except web.HTTPException as e:  # aiohttp's own: unknown path (404), wrong method (405)
            response = error_response(OpenAIError(e.status, f"{e.reason} ({request.method} {request.path})"))
            if "Allow" in e.headers:  # RFC 9110: a 405 says which methods the path takes
                response.headers["Allow"] = e.headers["Allow"]
            return response
        except (
            Exception
        ):  # a bug: the client still gets OpenAI's error shape and the id to report; the log the rest
            request_id = request.get("request_id")
            log.exception("%s %s %s failed", request_id or "-", request.method, request.path)
            response = error_response(
                OpenAIError(
                    500,
                    "internal server error" + (f" (request {request_id})" if request_id else ""),
                    code="internal_error",
                )
            )
            if request_id is not None:
                response.headers[REQUEST_ID_HEADER] = request_id
            return response
        finally:
            if conn is not None:
                conn.request_ended()

    async def _authenticate(self, request: web.Request, conn: _Connection | None) -> None:
        """The request's key, checked at its address's turn (the backoff shared with the msgpack door);
        a good key takes its connection out of the unauthenticated pool."""
        address = conn.address if conn is not None else client_address(request.remote or "")
        if not await self.hub.auth_turn(address):
            raise OpenAIError(  # Retry-After: when the address's queued turns have run
                429,
                "too many failed auths from this address; retry later",
                code="rate_limit_exceeded",
                retry_after_s=self.hub.backoff_wait_s(address),
            )
        accepted, request["key"] = self.hub.authenticate(_bearer(request), address)
        if not accepted:
            raise OpenAIError(401, _UNAUTHORIZED_MESSAGE, code="invalid_api_key")
        if conn is not None and request["key"] is not None and not self.hub.pool.grant(conn, request["key"]):
            raise OpenAIError(
                429,
                f"more than {self.hub.limits.max_connections} connections",
                code="overloaded",
                retry_after_s=OVERLOADED_RETRY_S,
            )

    async def _json(self, request: web.Request):
        # The body must arrive whole within the message deadline of the request's start.
        limit = self.hub.limits.message_timeout_s
        try:
            async with asyncio.timeout(limit):
                raw = await request.read()
        except TimeoutError:
            raise OpenAIError(408, f"the request body took more than {limit:.0f}s to arrive") from None
        try:
            body = json.loads(raw)
        except UnicodeDecodeError as e:
            raise OpenAIError(400, f"the request body is not UTF-8 text (byte {e.start})") from None
        except json.JSONDecodeError as e:
            raise OpenAIError(400, f"the request body is not valid JSON: {e.msg} (char {e.pos})") from None
        except ValueError:  # Python's cap on an integer's digits, which its message tells how to raise
            raise OpenAIError(
                400, f"the request body holds an integer of more than {sys.get_int_max_str_digits()} digits"
            ) from None
        except RecursionError:
            raise OpenAIError(400, "the request body is not valid JSON: nested too deeply") from None
        # JSON may escape a lone UTF-16 surrogate (\ud800), which is no text: refuse it here, not in the
        # tokenizer.
        if _SURROGATE_ESCAPE.search(raw):
            try:
                json.dumps(body, ensure_ascii=False).encode()
            except UnicodeEncodeError:
                raise OpenAIError(
                    400, "the request body holds a lone UTF-16 surrogate escape, which is not text"
                ) from None
        return body

    def _request_id(self, request: web.Request, kind: str) -> str:
        given = request.headers.get(REQUEST_ID_HEADER)
        if given is not None and not valid_request_id(given):
            raise OpenAIError(400, f"{REQUEST_ID_HEADER} must be {REQUEST_ID_RULE}", param=REQUEST_ID_HEADER)
        prefix = {"chat": "chatcmpl-", "messages": "msg_", "embedding": "embd-"}.get(kind, "cmpl-")
        request["request_id"] = given or f"{prefix}{uuid.uuid4().hex}"
        return request["request_id"]

    def _client_ip(self, request: web.Request) -> str:
        """For the request log: the client's IP, as a trusted proxy's header named it."""
        conn = self.connections.get(request.transport)
        return conn.ip if conn is not None else request.remote or ""

    # ------------------------------------------------------------------------------------------ endpoints

    async def _health(self, request):
        return web.json_response({"status": "ok"})

    async def _ready(self, request):
        if not self.hub.accepting:
            return web.json_response({"status": "draining"}, status=503)
        return web.json_response({"status": "ready"})

    async def _metrics(self, request):
        await self.hub.engine_call(lambda: self.metrics.read_engine(self.hub.engine))
        return web.Response(body=self.metrics.exposition(), headers={"Content-Type": CONTENT_TYPE})

    async def _models(self, request):
        return web.json_response({"object": "list", "data": [self._model_card()]})

    async def _model(self, request):
        name = request.match_info["model"]
        if name != self.model_name:
            raise OpenAIError(
                404,
                f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )
        return web.json_response(self._model_card())

    def _model_card(self) -> dict:
        return {
            "id": self.model_name,
            "object": "model",
            "created": self._created,
            "owned_by": "minisarathi",
            "max_model_len": self.hub.engine.max_model_len,
            "weight_format": self.hub.engine.model.weight_format,
        }

    async def _completions(self, request):
        request_id = self._request_id(request, "completion")
        received = time.monotonic()
        parsed = parse_completion(await self._json(request), self.model_name, self.limits)
        call = _Call(request_id, "completion", parsed, self._client_ip(request), received, request.get("key"))
        await self._prepare(call, "prompt", add_special_tokens=True)
        return await self._generate(request, call)

    async def _messages(self, request):
        """Anthropic's Messages API: the chat path, with its body and answers in Anthropic's shapes."""
        return await self._chat(request, "messages")

    async def _embeddings(self, request):
        """OpenAI's embeddings: each input one prefill-only engine request (server/embeddings.py)."""
        request_id = self._request_id(request, "embedding")
        received = time.monotonic()
        hidden = self.hub.engine.model_config.hidden_size
        parsed = embeddings.parse_openai(await self._json(request), self.model_name, self.limits, hidden)
        client = self._client_ip(request)
        try:
            body = await embeddings.http_embeddings(
                self.hub, parsed, request_id, client, request.get("key"), received
            )
        except RPCError as e:
            raise _from_rpc(e, self.hub.accepting) from None
        return web.json_response(body, headers={REQUEST_ID_HEADER: request_id})

    async def _chat(self, request, kind: str = "chat"):
        request_id = self._request_id(request, kind)
        received = time.monotonic()
        body = await self._json(request)
        if self.templates is None:
            raise OpenAIError(
                400,
                "this model has no chat template (chat_template in tokenizer_config.json, "
                "chat_template.jinja, or a GGUF file's tokenizer.chat_template); use /v1/completions or "
                "start the server with --chat-template FILE",
                param="messages",
                code="no_chat_template",
            )
        parse = anthropic_api.parse_messages if kind == "messages" else parse_chat
        parsed = parse(body, self.model_name, self.limits, self.tool_format)
        call = _Call(request_id, kind, parsed, self._client_ip(request), received, request.get("key"))
        await self._prepare(call, "messages", add_special_tokens=False)
        return await self._generate(request, call)

    async def _prepare(self, call: _Call, param: str, add_special_tokens: bool) -> None:
        """What the queue and the key's quota would refuse is refused before any rendering or tokenizing;
        then a chat request's messages are rendered (in the template worker), the text prompts become token
        ids, and a max_tokens the client left out fits the key and the context."""
        parsed = call.request
        self._fit_max_tokens(call)
        prompts, n = parsed.prompts, parsed.params.n
        floor = sum(1 if p is None else len(p) for p in prompts) + len(prompts) * n * parsed.params.max_tokens
        try:
            self.hub.precheck(call.key, parsed.params.max_tokens, floor, len(prompts) * n, len(prompts))
        except RPCError as e:
            raise _from_rpc(e, self.hub.accepting) from None
        if parsed.messages is not None:
            try:
                parsed.prompt_texts[0] = await self.templates.render(
                    parsed.messages,
                    parsed.add_generation_prompt,
                    parsed.chat_template_kwargs,
                    None if parsed.tools is None else parsed.tools.tools,
                )
            except ChatTemplateError as e:
                raise OpenAIError(400, f"the chat template refused the messages: {e}", param=param) from None
        await self._encode_prompts(parsed, param, add_special_tokens)
        self._fit_max_tokens(call)

    def _fit_max_tokens(self, call: _Call) -> None:
        """A chat request without max_tokens may run to the end of the context (OpenAI's meaning): within the
        server's cap, the key's max_tokens, and what the key's tokens per minute leave after the prompts (a
        text prompt not yet tokenized counts one token)."""
        parsed = call.request
        if parsed.max_tokens_given:
            return
        lengths = [1 if p is None else len(p) for p in parsed.prompts]
        fit = min(self.limits.max_tokens, self.hub.engine.max_model_len - max(lengths))
        key = call.key
        if key is not None and key.max_tokens is not None:
            fit = min(fit, key.max_tokens)
        if key is not None and key.tpm is not None:
            fit = min(fit, (key.tpm - sum(lengths)) // (len(lengths) * parsed.params.n))
        parsed.params.max_tokens = max(fit, 1)

    async def _encode_prompts(self, parsed: GenerationRequest, param: str, add_special_tokens: bool) -> None:
        """The text prompts as token ids, each refused by its bytes before it is tokenized and by its tokens
        after; a big one is tokenized off the event loop (Hub.encode_prompt)."""
        for i, text in enumerate(parsed.prompt_texts):
            if text is None:
                continue
            try:
                parsed.prompts[i] = await self.hub.encode_prompt(text, param, add_special_tokens)
            except RPCError as e:
                raise OpenAIError(400, e.message, param=param) from None
            check_prompt_length(parsed.prompts[i], self.limits, param)

    # ------------------------------------------------------------------------------------------ generation

    async def _generate(self, request: web.Request, call: _Call):
        self._submit(call)
        try:
            # The engine's checks (e.g. logit_bias ids within the vocabulary) answer before a stream starts: a
            # refused request is a 400, not an error event in a 200 stream.
            await asyncio.wait(call.added)
            error = next((c.error for c in call.choices if c.error is not None), None)
            if error is not None:
                raise _from_rpc(error)
            if call.request.stream:
                return await self._stream(request, call)
            while not all(c.done for c in call.choices):
                await call.wake.wait()
                call.wake.clear()
            error = next((c.error for c in call.choices if c.error is not None), None)
            if error is not None:
                raise _from_rpc(error)
            body = anthropic_api.message_body(call) if call.kind == "messages" else self._final_body(call)
            return web.json_response(body, headers={REQUEST_ID_HEADER: call.request_id})
        finally:
            self._end(call)

    def _end(self, call: _Call) -> None:
        """The request's unfinished prompts are aborted, each prompt reported, and the key's quota gets back
        what was not used: a refused prompt's all, an aborted one's what the engine did not generate."""
        firsts = _first_of_each_prompt(call)
        unfinished = [c for c in firsts if not c.done]
        if unfinished:
            log.info("%s aborted: client disconnected", call.request_id)
        for choice in firsts:
            self._report(call, choice)
        quota = call.quota
        if quota is None:
            for choice in unfinished:
                self.hub.cancel(choice.engine_id)
            return
        n = call.request.params.n
        refused = [c for c in firsts if isinstance(c.error, EngineRefused)]
        ran = [c for c in firsts if c not in refused]
        prompt_tokens = sum(len(call.request.prompts[c.prompt]) for c in ran)
        generated = sum(len(o.token_ids) for c in ran if c.done and c.output for o in c.output.outputs)
        waiting = len(unfinished)

        def settle() -> None:
            quota.finish(call.charged_tokens, prompt_tokens, generated, len(firsts) * n, len(refused) * n)

        def aborted(tokens: int) -> None:  # once per unfinished prompt, when the engine let go of it
            nonlocal generated, waiting
            generated += tokens
            waiting -= 1
            if not waiting:
                settle()

        for choice in unfinished:
            self.hub.cancel(choice.engine_id, aborted)
        if not unfinished:
            settle()

    def _submit(self, call: _Call) -> None:
        """One engine request per prompt; the engine runs its n choices on the prompt's shared KV blocks."""
        params, prompts = call.request.params, call.request.prompts
        # The door's prefix keeps the engine's id space apart from the msgpack door's.
        engine_ids = [
            f"http:{call.request_id}" + (f"-{p}" if len(prompts) > 1 else "") for p in range(len(prompts))
        ]
        if any(self.hub.in_use(engine_id) for engine_id in engine_ids):
            raise OpenAIError(
                400,
                f"{REQUEST_ID_HEADER} {call.request_id!r} is already in use by a request in flight",
                param=REQUEST_ID_HEADER,
            )
        charge = sum(len(p) + params.n * params.max_tokens for p in prompts)
        requests = len(prompts) * params.n
        try:
            call.quota = self.hub.admit(call.key, params.max_tokens, charge, requests)
        except RPCError as e:
            raise _from_rpc(e) from None
        call.charged_tokens = charge
        for p, (prompt, engine_id) in enumerate(zip(prompts, engine_ids)):
            group = [_Choice(p * params.n + i, p, i, engine_id, call.request.stream) for i in range(params.n)]

            def on_output(output, group=group):
                for choice in group:
                    choice.receive(output)
                call.wake.set()

            try:
                self.hub.open(engine_id, on_output)
            except RPCError as e:
                for earlier in _first_of_each_prompt(call):
                    self.hub.cancel(earlier.engine_id)
                call.choices.clear()
                if call.quota is not None:  # nothing ran: the whole charge comes back
                    call.quota.finish(call.charged_tokens, 0, 0, requests, requests)
                    call.quota = None
                raise _from_rpc(e, self.hub.accepting) from None
            priority = call.request.priority
            if priority is None:  # the key's, as a msgpack connection's default
                priority = 0 if call.key is None else call.key.priority
            call.added.append(
                self.hub.submit(
                    engine_id,
                    prompt,
                    params,
                    call.received,
                    priority,
                    stream=call.request.stream,
                    confirm=True,
                )
            )
            call.choices += group
        log.info(
            "%s from %s: %d prompt(s) x %d choice(s), %d prompt tokens, max_tokens=%d, stream=%s",
            call.request_id,
            call.client,
            len(prompts),
            params.n,
            sum(len(p) for p in prompts),
            params.max_tokens,
            call.request.stream,
        )

    async def _stream(self, request: web.Request, call: _Call) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                REQUEST_ID_HEADER: call.request_id,
            }
        )
        await response.prepare(request)
        if request.transport is not None:
            bound_kernel_buffer(request.transport.get_extra_info("socket"))
        try:
            if call.kind == "messages":
                await anthropic_api.write_events(
                    call, lambda data: self._send(request, response, call, data), _from_rpc
                )
                await response.write_eof()
            else:
                await self._write_events(request, response, call)
        except ConnectionError:  # the client went away between two writes
            pass
        return response

    async def _write_events(self, request: web.Request, response: web.StreamResponse, call: _Call) -> None:
        while True:
            events = []
            for choice in call.choices:
                if choice.error is not None and choice.slot == 0 and not choice.error_sent:
                    events.append(_from_rpc(choice.error, self.hub.accepting).body())
                    choice.error_sent = True
                while choice.deltas:
                    events += self._chunks(call, choice, choice.deltas.popleft())
            if events:
                await self._send(request, response, call, b"".join(_sse(event) for event in events))
            if any(c.error is not None for c in call.choices) or all(c.done for c in call.choices):
                break
            await call.wake.wait()
            call.wake.clear()
        if call.request.include_usage and all(c.error is None for c in call.choices):
            await response.write(
                _sse({**self._envelope(call, chunk=True), "choices": [], "usage": self._usage(call)})
            )
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()

    async def _send(self, request: web.Request, response: web.StreamResponse, call: _Call, data: bytes):
        """Write a stream's events. A client that stopped reading has its requests paused (their batch slots
        go to others, their output stops growing here) until it reads again, and aborted (ConnectionError)
        if it does not within --unread-timeout, as on the msgpack door."""
        await response.write(data)
        transport = request.transport
        if transport is None or transport.get_write_buffer_size() <= UNREAD_HIGH_WATER:
            return
        engine_ids = [c.engine_id for c in _first_of_each_prompt(call) if not c.done]
        self.hub.pause(engine_ids, True)
        deadline = time.monotonic() + self.hub.limits.unread_timeout_s
        poll_s = 0.05  # public API only: aiohttp offers no awaitable drain of its own
        while transport.get_write_buffer_size() > UNREAD_HIGH_WATER // 2:
            if transport.is_closing():
                raise ConnectionResetError("the client went away")
            if time.monotonic() >= deadline:
                log.warning(
                    "%s left its stream unread for %.0fs; aborting it",
                    call.request_id,
                    self.hub.limits.unread_timeout_s,
                )
                self.hub.counters["unread_aborts"] += len(engine_ids)
                transport.close()
                raise ConnectionResetError("stream left unread")
            await asyncio.sleep(poll_s)
            poll_s = min(2 * poll_s, 1.0)
        self.hub.pause(engine_ids, False)

    def _chunks(self, call: _Call, choice: _Choice, delta: _Delta) -> list[dict]:
        """The stream chunk of one delta (and, first in a chat stream, the role's)."""
        piece, new_ids, reason = delta.text, delta.token_ids, delta.finish_reason
        logprobs = None
        if call.request.logprobs is not None and new_ids:
            logprobs = (
                completion_logprobs(new_ids, delta.logprobs, call.request.logprobs, delta.text_offset)
                if call.kind == "completion"
                else chat_logprobs(
                    new_ids, delta.logprobs, call.request.logprobs, self.hub.engine.tokenizer.token_bytes
                )
            )
        if call.kind == "completion":
            body = {"index": choice.index, "text": piece, "logprobs": logprobs, "finish_reason": reason}
            return [self._chunk(call, body)]
        chunks = []
        if not choice.started:
            chunks.append(
                self._chunk(
                    call,
                    {
                        "index": choice.index,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    },
                )
            )
            choice.started = True
        if call.request.tools is None:
            deltas = [{"content": piece} if piece or not reason else {}]
        else:  # content and tool-call deltas, as the parser tells them apart (it may hold text back)
            choice.tools = choice.tools or ToolStream(call.request.tools)
            deltas = choice.tools.deltas(piece, reason is not None)
            reason = choice.tools.finish_reason(reason)
            if not deltas and (reason or logprobs):
                deltas = [{}]
        for i, delta in enumerate(deltas):  # the logprobs on the first, the finish reason on the last
            body = {
                "index": choice.index,
                "delta": delta,
                "logprobs": logprobs if i == 0 else None,
                "finish_reason": reason if i == len(deltas) - 1 else None,
            }
            chunks.append(self._chunk(call, body))
        return chunks

    def _chunk(self, call: _Call, choice_body: dict) -> dict:
        chunk = {**self._envelope(call, chunk=True), "choices": [choice_body]}
        if call.request.include_usage:
            chunk["usage"] = None
        return chunk

    def _envelope(self, call: _Call, chunk: bool) -> dict:
        kind = (
            ("chat.completion.chunk" if chunk else "chat.completion")
            if call.kind == "chat"
            else "text_completion"
        )
        return {
            "id": call.request_id,
            "object": kind,
            "created": call.created,
            "model": call.request.model,
            "system_fingerprint": None,
        }

    def _final_body(self, call: _Call) -> dict:
        choices = []
        for choice in call.choices:
            completion = choice.output.outputs[choice.slot]
            logprobs = None
            if call.request.logprobs is not None:
                logprobs = (
                    completion_logprobs(completion.token_ids, completion.logprobs, call.request.logprobs, 0)
                    if call.kind == "completion"
                    else chat_logprobs(
                        completion.token_ids,
                        completion.logprobs,
                        call.request.logprobs,
                        self.hub.engine.tokenizer.token_bytes,
                    )
                )
            body = {"index": choice.index, "logprobs": logprobs, "finish_reason": finish_reason(completion)}
            if call.kind == "completion":
                body["text"] = completion.text
            elif call.request.tools is None:
                body["message"] = {"role": "assistant", "content": completion.text}
            else:
                body["message"], body["finish_reason"] = tool_message(
                    call.request.tools, completion.text, body["finish_reason"]
                )
            choices.append(body)
        return {**self._envelope(call, chunk=False), "choices": choices, "usage": self._usage(call)}

    def _usage(self, call: _Call) -> dict:
        # Each prompt counts once however many choices it has (they share its KV blocks).
        outputs = [c.output for c in _first_of_each_prompt(call) if c.output is not None]
        completion_tokens = sum(len(c.token_ids) for output in outputs for c in output.outputs)
        return usage(
            sum(len(p) for p in call.request.prompts),
            completion_tokens,
            sum(output.num_cached_tokens for output in outputs),
        )

    def _report(self, call: _Call, first: _Choice) -> None:
        """The request log line and metrics of one prompt's engine request (all its choices)."""
        output = first.output
        if output is None and first.error is not None:
            return  # never ran (rejected, or the server stopped first)
        prompt = call.request.prompt_texts[first.prompt] or call.request.prompts[first.prompt]
        prompt_tokens = len(call.request.prompts[first.prompt])
        if output is None:  # aborted before its first output (cancel drops the engine's abort output)
            finished = FinishedRequest(
                first.engine_id.removeprefix("http:"),
                "http",
                call.client,
                prompt,
                prompt_tokens,
                0,
                0,
                "abort",
                None,
            )
        else:
            finished = FinishedRequest(
                first.engine_id.removeprefix("http:"),
                "http",
                call.client,
                prompt,
                prompt_tokens,
                output.num_cached_tokens,
                sum(len(c.token_ids) for c in output.outputs),
                output.outputs[0].finish_reason if output.finished else "abort",
                output.metrics,
            )
        self.hub.report_finished(finished)


def _first_of_each_prompt(call: _Call) -> list[_Choice]:
    return [c for c in call.choices if c.slot == 0]


def _bearer(request: web.Request) -> str | None:
    """The API key: Authorization: Bearer KEY, or Anthropic's x-api-key header."""
    scheme, _, key = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() == "bearer" and key.strip():
        return key.strip()
    return request.headers.get("x-api-key", "").strip() or None


def _sse(event: dict) -> bytes:
    return b"data: " + json.dumps(event, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def _error_response(error: OpenAIError) -> web.Response:
    headers = (
        None if error.retry_after_s is None else {"Retry-After": str(max(1, math.ceil(error.retry_after_s)))}
    )
    return web.json_response(error.body(), status=error.status, headers=headers)


def _from_rpc(error: RPCError, accepting: bool = True) -> OpenAIError:
    """The shared engine bridge's errors as HTTP statuses."""
    if error.code == INVALID_PARAMS:  # the engine's messages start with the field they are about
        field_name = error.message.split(" ", 1)[0]
        return OpenAIError(400, error.message, param=field_name if field_name in REQUEST_FIELDS else None)
    # overloaded and draining: Retry-After is overloaded's small constant (a draining replica's client
    # retries through its balancer, which sends it elsewhere)
    if error.code in (OVERLOADED, ABORTED):
        status, code = (429, "overloaded") if error.code == OVERLOADED and accepting else (503, "draining")
        return OpenAIError(status, error.message, code=code, retry_after_s=OVERLOADED_RETRY_S)
    if error.code == UNAUTHORIZED:  # the key was removed (SIGHUP) while the request arrived
        return OpenAIError(401, _UNAUTHORIZED_MESSAGE, code="invalid_api_key")
    if error.code == RATE_LIMITED:
        return OpenAIError(429, error.message, code="rate_limit_exceeded", retry_after_s=error.retry_after_s)
    return OpenAIError(500, error.message, code="internal_error")
