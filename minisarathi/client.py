"""Clients for the MessagePack-RPC server: Client (blocking sockets) and AsyncClient (asyncio, many in
flight)."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import itertools
import socket
import ssl
import time
from dataclasses import dataclass, field

import msgpack

from minisarathi.server.protocol import (
    ABORTED,
    CHUNK_NOTIFICATION,
    ERROR_NOTIFICATION,
    NOTIFICATION,
    OVERLOADED,
    REQUEST,
    RESPONSE,
    RPCError,
    make_unpacker,
    pack,
)

DEFAULT_PORT = 7000
_READ_SIZE = 1 << 16


@dataclass
class StreamChunk:
    text: str  # the new piece of text; the pieces concatenate to the final text
    token_ids: list[int]  # the new token ids
    index: int = 0  # the choice it belongs to (n > 1); each choice's pieces concatenate to its text


@dataclass
class GenerateResult:
    text: str
    token_ids: list[int]
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    stop_reason: int | str | None = None
    logprobs: list | None = None  # per generated token: [{token_id, logprob, rank, decoded_token}, ...]
    extra: dict = field(default_factory=dict)  # timing and any other fields (ttft_s, e2e_s, cached_tokens)

    @classmethod
    def from_wire(cls, result: dict) -> GenerateResult:
        known = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        return cls(
            **{k: v for k, v in result.items() if k in known},
            extra={k: v for k, v in result.items() if k not in known},
        )


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
    draining for a restart closes its idle connections; docs/deploy.md), or that the server refuses because it
    is shutting down, is sent again on a new connection, up to `retries` times: the server had not accepted
    it, or is gone. A stream that already delivered a chunk, a timeout or any other error is never retried:
    they raise."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = DEFAULT_PORT,
        *,
        unix_socket: str | None = None,
        api_key: str | None = None,
        timeout: float | None = None,
        retries: int = 3,
        source_address: tuple[str, int] | None = None,
        tls: ssl.SSLContext | None = None,
    ):
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
        """attempt() on a connected socket; when the server did not take it, reconnect and try again."""
        for retry in range(self.retries + 1):
            try:
                if self._sock is None:
                    self._connect()
                return attempt()
            except (ConnectionError, RPCError) as e:
                if not _not_taken(e):
                    raise  # the server's answer: the connection stays as it is
                self.close()
                if retry == self.retries:
                    raise
                time.sleep(_backoff_s(retry))

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
                    raise RPCError.from_wire(message[2][0])  # the server rejected our bytes and closes
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
            self._abort_and_drain()  # closing a generator that never ran skips its `finally`

    def _chunks(self):
        done = False
        started = False  # a chunk arrived: the stream cannot be sent again without repeating text
        client = self._client
        try:
            for retry in itertools.count():
                try:
                    for message in client._messages():
                        if (
                            message[0] == NOTIFICATION
                            and message[1] == CHUNK_NOTIFICATION
                            and message[2][0] == self.msgid
                        ):
                            started = True
                            yield StreamChunk(**message[2][1])
                        elif message[0] == RESPONSE and message[1] == self.msgid:
                            done = True
                            self.result = GenerateResult.from_wire(_result(message))
                            return
                except (ConnectionError, RPCError) as e:
                    if isinstance(e, ConnectionError):
                        client.close()
                    if started or not _not_taken(e) or retry == client.retries:
                        raise
                    client.close()  # refused as the server shuts down: the next connection goes elsewhere
                    time.sleep(_backoff_s(retry))
                    done = False
                    self.msgid = client._retrying(lambda: client._send("generate", self._params))
        except RPCError:
            done = True  # an `error` notification: the server is closing the connection, nothing to abort
            raise
        finally:
            if not done and client._sock is not None:  # a closed connection aborted it already
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

    Retries as Client does: a call or a stream the server did not take (its connection failed or closed before
    any of its answer arrived, or the server answered that it is shutting down) is sent again on a new
    connection, up to `retries` times; the requests still running on the old connection finish there. A stream
    that delivered a chunk, or any other error, raises."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = DEFAULT_PORT,
        *,
        unix_socket: str | None = None,
        api_key: str | None = None,
        tls: ssl.SSLContext | None = None,
        retries: int = 3,
        source_address: tuple[str, int] | None = None,
    ):
        self._address = (host, port, unix_socket, source_address)
        self._api_key = api_key
        self._tls = tls
        self.retries = retries
        self._msgids = itertools.count()  # unique over all of this client's connections
        self._current: _AsyncConnection | None = None  # where new requests go
        self._connections: set[_AsyncConnection] = set()  # the current one and draining ones still answering
        self._connect_lock = asyncio.Lock()

    async def connect(self) -> AsyncClient:
        await self._retrying(_connected)
        return self

    async def __aenter__(self):
        return await self.connect()

    async def __aexit__(self, *exc):
        await self.close()

    async def close(self):
        for conn in list(self._connections):
            await conn.close()
        self._current = None

    async def call(self, method: str, *params):
        return await self._retrying(lambda conn: conn.request(method, list(params)))

    async def generate(self, prompt: str | list[int], **sampling) -> GenerateResult:
        return GenerateResult.from_wire(
            await self.call("generate", *_generate_params(prompt, False, sampling))
        )

    def generate_stream(self, prompt: str | list[int], **sampling) -> AsyncStream:
        return AsyncStream(self, _generate_params(prompt, True, sampling))

    async def abort(self, msgid: int) -> bool:
        """Abort a request in flight; False if none of this client's connections holds it."""
        conn = next((c for c in self._connections if msgid in c.waiters), None)
        return False if conn is None else await conn.request("abort", [msgid])

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

    async def _connection(self) -> _AsyncConnection:
        """The connection new requests go on, opened (and authenticated) when there is none that takes
        them."""
        async with self._connect_lock:
            if self._current is None or not self._current.takes_requests:
                self._current = await self._open()
            return self._current

    async def _open(self) -> _AsyncConnection:
        host, port, unix_socket, source_address = self._address
        if unix_socket is not None:
            reader, writer = await asyncio.open_unix_connection(
                unix_socket, ssl=self._tls, server_hostname=None if self._tls is None else ""
            )
        else:
            reader, writer = await asyncio.open_connection(
                host, port, ssl=self._tls, local_addr=source_address
            )
        conn = _AsyncConnection(reader, writer, self._msgids)
        self._connections.add(conn)
        conn.reader_task.add_done_callback(lambda _: self._connections.discard(conn))
        if self._api_key is not None:
            try:
                await conn.request("auth", [self._api_key])
            except Exception:
                await conn.close()
                raise
        return conn

    async def _retrying(self, attempt):
        """await attempt(connection); when the server did not take it, again on a new connection."""
        for retry in range(self.retries + 1):
            conn = None
            try:
                conn = await self._connection()
                return await attempt(conn)
            except (ConnectionError, RPCError) as e:
                if not _not_taken(e) or retry == self.retries:
                    raise
                if conn is not None:
                    conn.draining = True
                await asyncio.sleep(_backoff_s(retry))


async def _connected(conn: _AsyncConnection) -> None:
    """AsyncClient.connect's attempt: opening the connection was all of it."""


class _AsyncConnection:
    """One connection of an AsyncClient: its reader and the requests in flight on it."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, msgids: itertools.count):
        self._writer = writer
        self._msgids = msgids
        self.waiters: dict[int, asyncio.Future] = {}
        self.streams: dict[int, asyncio.Queue] = {}
        self.draining = False  # the server said it is shutting down: no new request goes here
        self.reader_task = asyncio.ensure_future(self._read_loop(reader))

    @property
    def takes_requests(self) -> bool:
        return not self.draining and not self.reader_task.done()

    async def close(self):
        self._writer.close()
        self.reader_task.cancel()
        try:
            await self.reader_task
        except (asyncio.CancelledError, ConnectionError):
            pass

    async def request(self, method: str, params: list):
        return await self.send(method, params)[1]

    def send(
        self, method: str, params: list, chunks: asyncio.Queue | None = None
    ) -> tuple[int, asyncio.Future]:
        if self.reader_task.done():
            raise ConnectionError("the server closed the connection")
        msgid = next(self._msgids) % 2**32
        future = asyncio.get_running_loop().create_future()
        self.waiters[msgid] = future
        if chunks is not None:
            self.streams[msgid] = chunks
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
                        chunks = self.streams.pop(message[1], None)
                        if chunks is not None:
                            chunks.put_nowait(None)  # the stream ends; its chunks all came before
                        future = self.waiters.pop(message[1], None)
                        if future is not None and not future.done():
                            try:
                                future.set_result(_result(message))
                            except RPCError as e:
                                future.set_exception(e)
                    elif message[0] == NOTIFICATION and message[1] == CHUNK_NOTIFICATION:
                        chunks = self.streams.get(message[2][0])
                        if chunks is not None:
                            chunks.put_nowait(StreamChunk(**message[2][1]))
                    elif message[0] == NOTIFICATION and message[1] == ERROR_NOTIFICATION:
                        error = RPCError.from_wire(message[2][0])  # the server closes the connection next
        except ConnectionError as e:
            error = e
        finally:
            for chunks in self.streams.values():
                chunks.put_nowait(None)
            for future in self.waiters.values():
                if not future.done():
                    future.set_exception(error)
            self.streams.clear()
            self.waiters.clear()
            self._writer.close()


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
        client = self._client
        for retry in range(client.retries + 1):
            started = False  # a chunk arrived: sending the request again would repeat its text
            conn = None
            try:
                conn = await client._connection()
                chunks: asyncio.Queue = asyncio.Queue()  # StreamChunk..., then None
                self.msgid, response = conn.send("generate", self._params, chunks)
                try:
                    while (chunk := await chunks.get()) is not None:
                        started = True
                        yield chunk
                    self.result = GenerateResult.from_wire(await response)
                    return
                finally:
                    if not response.done():  # left early: abort it on the server
                        await conn.request("abort", [self.msgid])
                        try:
                            await response
                        except RPCError as e:
                            if e.code != ABORTED:
                                raise
            except (ConnectionError, RPCError) as e:
                if started or not _not_taken(e) or retry == client.retries:
                    raise
                if conn is not None:
                    conn.draining = True
                await asyncio.sleep(_backoff_s(retry))


# The server's answer to a request that arrives while it drains (server/hub.py): it did not take the request.
_SHUTTING_DOWN = "server is shutting down"


def _not_taken(error: Exception) -> bool:
    """The server did not take the request: its connection failed or closed before any of the answer arrived
    (refused, reset, closed by a draining server), or it answered that it is shutting down."""
    if isinstance(error, RPCError):
        return error.code == OVERLOADED and error.message == _SHUTTING_DOWN
    return isinstance(error, ConnectionError)


def _backoff_s(retry: int) -> float:
    return min(1.0, 0.05 * 2**retry)
