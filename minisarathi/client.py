"""Clients for the MessagePack-RPC server: Client (blocking sockets) and AsyncClient (asyncio, many in flight)."""
from __future__ import annotations

import asyncio
import itertools
import inspect
import socket
import ssl
import time
import dataclasses
from dataclasses import dataclass, field

import msgpack

from minisarathi.server.protocol import (ABORTED, CHUNK_NOTIFICATION, ERROR_NOTIFICATION, NOTIFICATION, REQUEST,
                                         RESPONSE, RPCError, make_unpacker, pack)

DEFAULT_PORT = 7000
_READ_SIZE = 1 << 16


@dataclass
class StreamChunk:
    text: str              # the new piece of text; the pieces concatenate to the final text
    token_ids: list[int]   # the new token ids
    index: int = 0         # the choice it belongs to (n > 1); each choice's pieces concatenate to its text


@dataclass
class GenerateResult:
    text: str
    token_ids: list[int]
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    stop_reason: int | str | None = None
    logprobs: list | None = None      # per generated token: [{token_id, logprob, rank, decoded_token}, ...]
    extra: dict = field(default_factory=dict)   # timing and any other fields (ttft_s, e2e_s, cached_tokens)

    @classmethod
    def from_wire(cls, result: dict) -> GenerateResult:
        known = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        return cls(**{k: v for k, v in result.items() if k in known},
                   extra={k: v for k, v in result.items() if k not in known})


def _generate_params(prompt: str | list[int], stream: bool, sampling: dict) -> list:
    fields = {"prompt_token_ids" if isinstance(prompt, list) else "prompt": prompt, "stream": stream}
    return [{**fields, **sampling}]


def _unpacker() -> msgpack.Unpacker:
    # Responses carry whole texts and token lists; allow generously more than a request may hold.
    return make_unpacker(64 << 20)


class Client:
    """Blocking client; one call at a time. A stream must be consumed (or closed, which aborts it) before
    the next call.

    A call whose connection fails or closes before any of its answer arrived (a replica behind a load balancer
    draining for a restart closes its idle connections; docs/deploy.md) is sent again on a new connection, up
    to `retries` times: the server had not accepted it, or is gone. A stream that already delivered a chunk,
    or a timeout, is never retried: they raise."""

    def __init__(self, host: str = "127.0.0.1", port: int = DEFAULT_PORT, *, unix_socket: str | None = None,
                 api_key: str | None = None, timeout: float | None = None, retries: int = 3,
                 source_address: tuple[str, int] | None = None, tls: ssl.SSLContext | None = None):
        """tls: a client SSLContext (ssl.create_default_context(cafile=...)) to speak TLS; the server's
        certificate is checked against `host`."""
        self._address = (host, port, unix_socket, timeout, source_address)
        self._tls = tls
        self._api_key = api_key
        self.retries = retries
        self._msgids = itertools.count()
        self._sock: socket.socket | None = None
        self._retrying(lambda: None)

    def _connect(self):
        host, port, unix_socket, timeout, source_address = self._address
        if unix_socket is not None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(timeout)
            try:
                sock.connect(unix_socket)
            except OSError:
                sock.close()
                raise
        else:
            sock = socket.create_connection((host, port), timeout=timeout, source_address=source_address)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self._tls is not None:
            try:
                sock = self._tls.wrap_socket(sock, server_hostname=host if unix_socket is None else None)
            except Exception:
                sock.close()
                raise
        self._sock = sock
        self._unpacker = _unpacker()
        if self._api_key is not None:
            try:
                self._call_once("auth", [self._api_key])
            except Exception:
                self.close()
                raise

    def _retrying(self, attempt):
        """attempt() on a connected socket; on a connection failure, reconnect and try again."""
        for retry in range(self.retries + 1):
            try:
                if self._sock is None:
                    self._connect()
                return attempt()
            except ConnectionError:   # refused, reset, or closed before the answer began
                self.close()
                if retry == self.retries:
                    raise
                time.sleep(0.05 * 2 ** retry)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def call(self, method: str, *params):
        """One request; returns its result or raises RPCError."""
        return self._retrying(lambda: self._call_once(method, list(params)))

    def _call_once(self, method: str, params: list):
        msgid = self._send(method, params)
        for message in self._messages():
            if message[0] == RESPONSE and message[1] == msgid:
                return _result(message)

    def generate(self, prompt: str | list[int], **sampling) -> GenerateResult:
        """sampling: SamplingParams fields (max_tokens, temperature, stop, seed, ...)."""
        return GenerateResult.from_wire(self.call("generate", *_generate_params(prompt, False, sampling)))

    def generate_stream(self, prompt: str | list[int], **sampling) -> Stream:
        params = _generate_params(prompt, True, sampling)
        return Stream(self, params, self._retrying(lambda: self._send("generate", params)))

    def tokenize(self, text: str) -> list[int]:
        return self.call("tokenize", text)

    def detokenize(self, token_ids: list[int]) -> str:
        return self.call("detokenize", token_ids)

    def model_info(self) -> dict:
        return self.call("model_info")

    def health(self) -> dict:
        return self.call("health")

    def stats(self) -> dict:
        return self.call("stats")

    def auth(self, api_key: str) -> bool:
        return self.call("auth", api_key)

    def _send(self, method: str, params: list) -> int:
        msgid = next(self._msgids) % 2**32
        self._sock.sendall(pack([REQUEST, msgid, method, params]))
        return msgid

    def _messages(self):
        while True:
            for message in self._unpacker:
                if message[0] == NOTIFICATION and message[1] == ERROR_NOTIFICATION:
                    raise RPCError.from_wire(message[2][0])   # the server rejected our bytes and closes
                yield message
            data = self._sock.recv(_READ_SIZE)
            if not data:
                raise ConnectionError("server closed the connection")
            self._unpacker.feed(data)


class Stream:
    """Iterate for StreamChunks; `result` holds the GenerateResult once the stream ends.
    Closing it early (break, close()) aborts the request on the server."""

    def __init__(self, client: Client, params: list, msgid: int):
        self._client = client
        self._params = params
        self.msgid = msgid
        self.result: GenerateResult | None = None
        self._iterator = self._chunks()

    def __iter__(self):
        return self._iterator

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        never_started = inspect.getgeneratorstate(self._iterator) == inspect.GEN_CREATED
        self._iterator.close()
        if never_started and self._client._sock is not None:
            self._abort_and_drain()   # closing a generator that never ran skips its `finally`

    def _chunks(self):
        done = False
        started = False   # a chunk arrived: the stream cannot be sent again without repeating text
        client = self._client
        try:
            for retry in itertools.count():
                try:
                    for message in client._messages():
                        if (message[0] == NOTIFICATION and message[1] == CHUNK_NOTIFICATION
                                and message[2][0] == self.msgid):
                            started = True
                            yield StreamChunk(**message[2][1])
                        elif message[0] == RESPONSE and message[1] == self.msgid:
                            done = True
                            self.result = GenerateResult.from_wire(_result(message))
                            return
                except ConnectionError:
                    client.close()
                    if started or retry == client.retries:
                        raise
                    time.sleep(0.05 * 2 ** retry)
                    self.msgid = client._retrying(lambda: client._send("generate", self._params))
        except RPCError:
            done = True   # an `error` notification: the server is closing the connection, nothing to abort
            raise
        finally:
            if not done and client._sock is not None:   # a closed connection aborted it already
                self._abort_and_drain()

    def _abort_and_drain(self):
        # Leave the connection clean for the next call: the abort's reply and the stream's final (error)
        # response both arrive, in either order.
        abort_id = self._client._send("abort", [self.msgid])
        waiting = {abort_id, self.msgid}
        for message in self._client._messages():
            if message[0] == RESPONSE and message[1] in waiting:
                waiting.discard(message[1])
                if not waiting:
                    return


def _result(message):
    _, _, error, result = message
    if error is not None:
        raise RPCError.from_wire(error)
    return result


class AsyncClient:
    """asyncio client: any number of calls and streams in flight on one connection.

        async with AsyncClient("127.0.0.1", 7000) as c:
            result = await c.generate("Once upon a time", max_tokens=32, temperature=0)
    """

    def __init__(self, host: str = "127.0.0.1", port: int = DEFAULT_PORT, *, unix_socket: str | None = None,
                 api_key: str | None = None, tls: ssl.SSLContext | None = None):
        self._address = (host, port, unix_socket)
        self._api_key = api_key
        self._tls = tls
        self._msgids = itertools.count()
        self._waiters: dict[int, asyncio.Future] = {}
        self._streams: dict[int, asyncio.Queue] = {}
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task | None = None

    async def connect(self) -> AsyncClient:
        host, port, unix_socket = self._address
        if unix_socket is not None:
            reader, self._writer = await asyncio.open_unix_connection(
                unix_socket, ssl=self._tls, server_hostname=None if self._tls is None else "")
        else:
            reader, self._writer = await asyncio.open_connection(host, port, ssl=self._tls)
        self._reader_task = asyncio.ensure_future(self._read_loop(reader))
        if self._api_key is not None:
            await self.auth(self._api_key)
        return self

    async def __aenter__(self):
        return await self.connect()

    async def __aexit__(self, *exc):
        await self.close()

    async def close(self):
        if self._writer is not None:
            self._writer.close()
            self._reader_task.cancel()
            try:
                await self._reader_task
            except (asyncio.CancelledError, ConnectionError):
                pass
            self._writer = None

    async def call(self, method: str, *params):
        _, response = self._send(method, list(params))
        return await response

    async def generate(self, prompt: str | list[int], **sampling) -> GenerateResult:
        return GenerateResult.from_wire(await self.call("generate", *_generate_params(prompt, False, sampling)))

    def generate_stream(self, prompt: str | list[int], **sampling) -> AsyncStream:
        return AsyncStream(self, _generate_params(prompt, True, sampling))

    async def abort(self, msgid: int) -> bool:
        return await self.call("abort", msgid)

    async def tokenize(self, text: str) -> list[int]:
        return await self.call("tokenize", text)

    async def detokenize(self, token_ids: list[int]) -> str:
        return await self.call("detokenize", token_ids)

    async def model_info(self) -> dict:
        return await self.call("model_info")

    async def health(self) -> dict:
        return await self.call("health")

    async def stats(self) -> dict:
        return await self.call("stats")

    async def auth(self, api_key: str) -> bool:
        return await self.call("auth", api_key)

    def _send(self, method: str, params: list, chunks: asyncio.Queue | None = None) -> tuple[int, asyncio.Future]:
        if self._writer is None:
            raise ConnectionError("not connected: use `async with AsyncClient(...)` or await connect()")
        if self._reader_task.done():
            raise ConnectionError("the server closed the connection")
        msgid = next(self._msgids) % 2**32
        future = asyncio.get_running_loop().create_future()
        self._waiters[msgid] = future
        if chunks is not None:
            self._streams[msgid] = chunks
        self._writer.write(pack([REQUEST, msgid, method, params]))
        return msgid, future

    async def _read_loop(self, reader: asyncio.StreamReader):
        unpacker = _unpacker()
        error: Exception = ConnectionError("server closed the connection")
        try:
            while data := await reader.read(_READ_SIZE):
                unpacker.feed(data)
                for message in unpacker:
                    if message[0] == RESPONSE:
                        chunks = self._streams.pop(message[1], None)
                        if chunks is not None:
                            chunks.put_nowait(None)   # the stream ends; its chunks all came before
                        future = self._waiters.pop(message[1], None)
                        if future is not None and not future.done():
                            try:
                                future.set_result(_result(message))
                            except RPCError as e:
                                future.set_exception(e)
                    elif message[0] == NOTIFICATION and message[1] == CHUNK_NOTIFICATION:
                        chunks = self._streams.get(message[2][0])
                        if chunks is not None:
                            chunks.put_nowait(StreamChunk(**message[2][1]))
                    elif message[0] == NOTIFICATION and message[1] == ERROR_NOTIFICATION:
                        error = RPCError.from_wire(message[2][0])   # the server closes the connection next
        except ConnectionError as e:
            error = e
        finally:
            for chunks in self._streams.values():
                chunks.put_nowait(None)
            for future in self._waiters.values():
                if not future.done():
                    future.set_exception(error)
            self._streams.clear()
            self._waiters.clear()


class AsyncStream:
    """`async for chunk in stream`; `result` holds the GenerateResult once it ends.
    Leaving early aborts the request (at once with `await stream.aclose()`)."""

    def __init__(self, client: AsyncClient, params: list):
        self._client = client
        self._params = params
        self._iterator = self._chunks()
        self.result: GenerateResult | None = None
        self.msgid: int | None = None

    def __aiter__(self):
        return self._iterator

    async def aclose(self):
        await self._iterator.aclose()

    async def _chunks(self):
        chunks: asyncio.Queue = asyncio.Queue()   # StreamChunk..., then None
        self.msgid, response = self._client._send("generate", self._params, chunks)
        try:
            while (chunk := await chunks.get()) is not None:
                yield chunk
            self.result = GenerateResult.from_wire(await response)
        finally:
            if not response.done():
                await self._client.abort(self.msgid)
                try:
                    await response
                except RPCError as e:
                    if e.code != ABORTED:
                        raise
