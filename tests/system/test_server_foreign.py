"""The server against other MessagePack-RPC clients' encodings, crafted byte by byte, and against clients
that misbehave (slow readers, partial writes, duplicate msgids, notifications).

What foreign clients send that our own client never does: bin (or old raw) strings for the method, map keys
and values (old Go codecs, Neovim); a bare map as params (old Go net/rpc codec); float32 for fractional
numbers (JavaScript msgpack5); integers in any width; integral floats; notifications to the server.
An optional test drives the real JavaScript client (msgpack5rpc) when node can load it.
"""

import json
import os
import re
import shutil
import socket
import struct
import subprocess
import threading

import msgpack
import pytest
from test_server import RawConnection, launch_server, wait_until_idle

from minisarathi.client import Client, RPCError
from minisarathi.server.protocol import ABORTED, INVALID_MESSAGE, INVALID_PARAMS, OVERLOADED

WRITE_BUFFER_CAP = 128 << 10
MAX_CONNECTIONS = 24
GREEDY_ZOO = {"prompt": "Zoo", "max_tokens": 6, "temperature": 0}


@pytest.fixture(scope="module")
def server():
    with launch_server(
        "--max-write-buffer-bytes",
        str(WRITE_BUFFER_CAP),
        "--max-connections",
        str(MAX_CONNECTIONS),
        "--chunk-size",
        "64",
    ) as s:
        yield s


@pytest.fixture(scope="module")
def zoo_reference(server):
    with Client("127.0.0.1", server.port) as client:
        return client.call("generate", GREEDY_ZOO)


def call_raw(server, raw: bytes):
    """Send raw bytes, return the first message back (None if the server closed the connection)."""
    conn = RawConnection(server)
    conn.sock.sendall(raw)
    message = conn.receive()
    conn.close()
    return message


def str_as_bin(value):
    """Every str in value as bin, the way an encoder without a str type sends text."""
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, list):
        return [str_as_bin(v) for v in value]
    if isinstance(value, dict):
        return {str_as_bin(k): str_as_bin(v) for k, v in value.items()}
    return value


def test_bin_method_keys_and_values_are_read_as_text(server, zoo_reference):
    # logit_bias' keys too: a nested map's keys sent as bin (a zero bias leaves the tokens as they were)
    request = [0, 1, "generate", [{**GREEDY_ZOO, "stop": ["zzz"], "logit_bias": {"407": 0.0}}]]
    binary = msgpack.packb(str_as_bin(request), use_bin_type=True)
    assert b"\xc4\x08generate" in binary and b"\xc4\x06prompt" in binary  # bin 8 = 0xc4
    kind, msgid, error, result = call_raw(server, binary)
    assert (kind, msgid, error) == (1, 1, None)
    assert result["token_ids"] == zoo_reference["token_ids"] and result["text"] == zoo_reference["text"]
    with Client("127.0.0.1", server.port) as client:
        with pytest.raises(RPCError) as info:  # bin that is not UTF-8 cannot be text
            client.call("tokenize", b"\xff\xfe")
        assert info.value.code == INVALID_PARAMS


def test_old_raw_strings_and_bare_map_params(server, zoo_reference):
    # An encoder from before the str/bin split (Go ugorji without WriteExt, msgpack-python
    # use_bin_type=False): strings as fixraw/raw16, never str8, and the old Go net/rpc codec's params = the
    # bare argument map.
    raw = msgpack.packb([0, 7, "generate", GREEDY_ZOO], use_bin_type=False)
    assert b"\xd9" not in raw
    response = call_raw(server, raw)
    assert response[:3] == [1, 7, None] and response[3]["token_ids"] == zoo_reference["token_ids"]


def test_response_bytes_are_what_strict_decoders_expect(server):
    # ugorji's MsgpackSpecRpc reads the first byte as exactly 0x94 (fixarray of 4), then the type byte.
    conn = RawConnection(server)
    conn.send([0, 3, "model_info", []])
    data = b""
    while True:
        data += conn.sock.recv(65536)
        try:
            response = msgpack.unpackb(data, raw=False)  # str -> str, bin -> bytes
            break
        except (ValueError, msgpack.UnpackException):  # not all of it yet
            continue
    conn.close()
    assert data[:4] == b"\x94\x01\x03\xc0"  # [1, 3, nil, ...
    texts = [response[3]["model"], response[3]["scheduler"], *response[3].keys()]
    assert all(type(text) is str for text in texts)  # text is str, never bin


@pytest.mark.parametrize(
    "encoded_msgid",
    [
        b"\x05",
        b"\xcc\x05",
        b"\xcd\x00\x05",
        b"\xce\x00\x00\x00\x05",
        b"\xcf" + struct.pack(">Q", 5),
        b"\xd0\x05",
        b"\xd1\x00\x05",
        b"\xd2\x00\x00\x00\x05",
        b"\xd3" + struct.pack(">q", 5),
    ],
    ids=["fixint", "uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64"],
)
def test_msgid_in_any_integer_width(server, encoded_msgid):
    raw = b"\x94\x00" + encoded_msgid + msgpack.packb("tokenize") + msgpack.packb(["Zoo"])
    assert call_raw(server, raw) == [1, 5, None, [1, 410, 469, 347]]


@pytest.mark.parametrize("msgid", [2**32, -1, 1.0, None])
def test_msgid_outside_uint32_gets_an_error_notification_and_a_close(server, msgid):
    conn = RawConnection(server)
    conn.send([0, msgid, "health", []])
    # No response: its msgid must be a uint32, and one we made up could match a real request.
    kind, method, params = conn.receive()
    assert (kind, method, params[0]["code"]) == (2, "error", INVALID_MESSAGE)
    assert conn.receive() is None
    conn.close()


def test_float32_and_integral_float_params(server, zoo_reference):
    # msgpack5 (JavaScript) sends 0.7 as float32 (0xca) and 1 as an int; some encoders send every number as
    # float64 (0xcb), integral ones included.
    fields = (
        b"\x84\xa6prompt\xa3Zoo\xaamax_tokens\xcb"
        + struct.pack(">d", 6.0)
        + b"\xabtemperature\xca"
        + struct.pack(">f", 0.0)
        + b"\xa5top_p\xca"
        + struct.pack(">f", 0.9)
    )
    kind, msgid, error, result = call_raw(server, b"\x94\x00\x01\xa8generate\x91" + fields)
    assert error is None and result["token_ids"] == zoo_reference["token_ids"]
    with Client("127.0.0.1", server.port) as client:
        with pytest.raises(RPCError) as info:
            client.call("generate", {"prompt": "Zoo", "max_tokens": 6.5})
        assert info.value.code == INVALID_PARAMS and "max_tokens" in info.value.message


def test_positional_generate_params(server, zoo_reference):
    options = {k: v for k, v in GREEDY_ZOO.items() if k != "prompt"}
    with Client("127.0.0.1", server.port) as client:
        assert client.call("generate", "Zoo", options)["token_ids"] == zoo_reference["token_ids"]
        ids = client.tokenize("Zoo")
        assert client.call("generate", ids, options)["token_ids"] == zoo_reference["token_ids"]
        with pytest.raises(RPCError) as info:
            client.call("generate", "Zoo", {"prompt": "Zoo"})
        assert info.value.code == INVALID_PARAMS and "prompt" in info.value.message


def test_request_split_across_many_writes(server):
    conn = RawConnection(server)
    conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    data = b"".join(msgpack.packb([0, i, "tokenize", ["Zoo"]]) for i in range(3))
    for i in range(0, len(data) - 5):  # one byte at a time, then two messages and a half at once
        conn.sock.sendall(data[i : i + 1])
    conn.sock.sendall(data[len(data) - 5 :])
    assert [conn.receive() for _ in range(3)] == [[1, i, None, [1, 410, 469, 347]] for i in range(3)]
    conn.close()


def test_notifications_from_the_client(server):
    conn = RawConnection(server)
    conn.send(
        [
            0,
            1,
            "generate",
            [{"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True}],
        ]
    )
    assert conn.receive()[:2] == [2, "generate.chunk"]
    # Ignored without a reply: a method whose result no one would receive, even a generate ...
    conn.send([2, "health", []], [2, "generate", [{"prompt": "Zoo"}]], [2, "no_such_method", 5])
    # ... while abort takes effect (the method name as bin, as old encoders send it).
    conn.sock.sendall(msgpack.packb([2, b"abort", [1]], use_bin_type=True))
    while (message := conn.receive())[0] == 2:
        pass
    assert message[:2] == [1, 1] and message[2]["code"] == ABORTED
    conn.send([0, 2, "health", []])
    assert conn.receive()[:3] == [1, 2, None]  # still open, and nothing else was sent
    conn.close()
    assert wait_until_idle(server)["tokens_generated"] >= 1


def test_duplicate_msgid_in_flight(server, zoo_reference):
    conn = RawConnection(server)
    conn.send(
        [0, 4, "generate", [{**GREEDY_ZOO, "max_tokens": 200, "ignore_eos": True}]],
        [0, 4, "generate", [GREEDY_ZOO]],
    )
    first = conn.receive()  # the duplicate is refused at once; the first runs to its end
    assert first[:2] == [1, 4] and first[2]["code"] == INVALID_PARAMS and "msgid 4" in first[2]["message"]
    second = conn.receive()
    assert second[:3] == [1, 4, None] and second[3]["completion_tokens"] == 200
    conn.close()
    wait_until_idle(server)


@pytest.mark.parametrize(
    "garbage, why",
    [
        (b"\x94\x00\x01\xa6health\x91\x81\x90\x01", "map key"),  # a map keyed by an array
        (b"\x94\x00\x01\xa6health\x91\xa2\xff\xfe", "not UTF-8"),  # a str that is not UTF-8
        (b"\x94\x00\x01\xa6health" + b"\x91" * 5000 + b"\xc0", "nested"),  # 5000 nested arrays
    ],
    ids=["array-as-map-key", "invalid-utf8", "deep-nesting"],
)
def test_undecodable_messages_get_an_error_notification(server, garbage, why):
    conn = RawConnection(server)
    conn.sock.sendall(garbage)
    kind, method, params = conn.receive()
    assert (kind, method, params[0]["code"]) == (2, "error", INVALID_MESSAGE) and why in params[0]["message"]
    # the rule, in the protocol's words: never a Python type or exception
    assert not re.search(r"Error|unhashable|'list'|'dict'", params[0]["message"]), params[0]["message"]
    assert conn.receive() is None
    conn.close()
    with Client("127.0.0.1", server.port) as client:
        assert client.health()["status"] == "ok"


def _stats(server) -> dict:
    with Client("127.0.0.1", server.port) as client:
        return client.stats()


def _unread_socket(server) -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(
        socket.SOL_SOCKET, socket.SO_RCVBUF, 4096
    )  # the kernel absorbs less of what we leave unread
    sock.connect(("127.0.0.1", server.port))
    sock.settimeout(60)
    return sock


def test_pipelining_client_that_does_not_read_is_throttled_not_buffered(server):
    """A client pipelines 30k requests (each answer ~25x its request, 10 MB in all) and reads nothing for a
    while: once 64 KiB of answers wait in the server, it stops taking that client's requests instead of
    buffering megabytes (or dropping the client), serves everyone else meanwhile, and the client gets every
    answer, in order, once it reads."""
    n = 30_000
    sock = _unread_socket(server)
    data = b"".join(msgpack.packb([0, i, "model_info", []]) for i in range(n))
    sender = threading.Thread(target=sock.sendall, args=(data,), daemon=True)
    sender.start()
    for _ in range(10_000):  # answers pile up until the reads pause ...
        if _stats(server)["write_buffer_bytes"] >= 60_000:
            break
    else:
        pytest.fail("answers never piled up")
    held = [_stats(server)["write_buffer_bytes"] for _ in range(20)]
    assert max(held) <= (64 << 10) + 1024, held  # ... and stay at the high-water mark
    unpacker = msgpack.Unpacker()
    received = 0
    while received < n:
        chunk = sock.recv(1 << 20)
        assert chunk, f"closed after {received} answers"
        unpacker.feed(chunk)
        for message in unpacker:
            assert message[:3] == [1, received, None]
            received += 1
    sender.join()
    sock.close()
    wait_until_idle(server)


def test_client_that_never_reads_holds_at_most_the_cap(server):
    """Answers wait in the server until the client reads them: while its requests are still read (up to
    64 KiB waiting), and for requests already running (stream chunks, final answers) up to
    --max-write-buffer-bytes, past which the connection is dropped. Either way the server holds no more than
    the cap for it, and everything is freed once the client goes away."""
    sock = _unread_socket(server)
    stream = {"prompt": "Zoo", "max_tokens": 300, "ignore_eos": True, "logprobs": 20, "stream": True}
    # The streams' final answers (~350 KB each) come whether or not the client reads; the tokenize answers
    # (~450 KB each, 18 MB in all) fill the kernel's buffers first.
    flood = b"".join(
        [msgpack.packb([0, i, "generate", [stream]]) for i in range(4)]
        + [msgpack.packb([0, i, "tokenize", ["xq" * 75_000]]) for i in range(4, 44)]
    )
    threading.Thread(target=_send_until_closed, args=(sock, flood), daemon=True).start()
    wait_until_idle(server)  # the streams ended (finished, or aborted with the connection)
    assert _stats(server)["write_buffer_bytes"] <= WRITE_BUFFER_CAP
    sock.close()
    for _ in range(10_000):
        stats = _stats(server)
        if stats["connections"] == 1 and stats["write_buffer_bytes"] == 0:  # just the one asking
            break
    else:
        pytest.fail(f"the connection was not cleaned up: {stats}")


def _receive_or_reset(conn: RawConnection):
    try:
        return conn.receive()
    except ConnectionResetError:
        return None


def _send_until_closed(sock: socket.socket, data: bytes):
    try:
        sock.sendall(data)
    except OSError:
        pass  # the server dropped the connection first


def test_connections_past_the_limit_are_refused(server):
    conns = [RawConnection(server) for _ in range(MAX_CONNECTIONS + 4)]
    for conn in conns:
        conn.send([0, 1, "health", []])
    answers = [_receive_or_reset(conn) for conn in conns]
    served = [a for a in answers if a is not None and a[0] == 1]
    refused = [a for a in answers if a is None or a[0] == 2]
    assert len(served) <= MAX_CONNECTIONS and len(served) + len(refused) == len(conns)
    # A refusal is the `error` notification, unless our request reached the server before it closed the
    # socket unread, which turns the close into a reset.
    notices = [a for a in refused if a is not None]
    assert notices and all(a[1] == "error" and a[2][0]["code"] == OVERLOADED for a in notices)
    for conn in conns:
        conn.close()
    wait_until_idle(server)  # room again: it connects


NODE_CLIENT = r"""
const net = require('net');
const Session = require('msgpack5rpc');
const sock = net.connect(parseInt(process.argv[1], 10), '127.0.0.1', async () => {
  const session = new Session();
  session.attach(sock, sock);
  const chunks = [];
  session.on('notification', (method, args) => chunks.push([method, args]));
  const call = (method, args) => new Promise((resolve) =>
    session.request(method, args, (error, result) => resolve({error, result})));
  const out = {health: await call('health', [])};
  out.greedy = await call('generate', [{prompt: 'Zoo', max_tokens: 6, temperature: 0}]);
  out.sampled = await call('generate',
                          [{prompt: 'Zoo', max_tokens: 6, temperature: 0.7, top_p: 0.95, seed: 3}]);
  out.stream = await call('generate', [{prompt: 'Zoo', max_tokens: 6, temperature: 0, stream: true}]);
  out.chunks = chunks;
  session.notify('abort', [12345]);
  out.bad = await call('generate', [{prompt: 'Zoo', colour: 'red'}]);
  out.after = await call('tokenize', ['Zoo']);
  console.log(JSON.stringify(out));
  sock.end();
});
"""


def test_javascript_msgpack5rpc_client(server, zoo_reference):
    """Optional: set NODE_PATH to a node_modules holding msgpack5rpc (`npm install msgpack5rpc` anywhere
    outside the repo); skipped otherwise, so the suite stays offline."""
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed")
    found = subprocess.run([node, "-e", "require.resolve('msgpack5rpc')"], capture_output=True)
    if found.returncode != 0:
        pytest.skip("msgpack5rpc is not on NODE_PATH (npm install msgpack5rpc outside the repo)")
    run = subprocess.run(
        [node, "-e", NODE_CLIENT, str(server.port)],
        capture_output=True,
        text=True,
        timeout=60,
        env=os.environ,
    )
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out["health"]["error"] is None and out["health"]["result"]["status"] == "ok"
    assert out["greedy"]["result"]["token_ids"] == zoo_reference["token_ids"]
    assert out["sampled"]["error"] is None and out["sampled"]["result"]["completion_tokens"] == 6
    assert out["stream"]["result"]["token_ids"] == zoo_reference["token_ids"]
    assert "".join(args[1]["text"] for _, args in out["chunks"]) == zoo_reference["text"]
    assert out["bad"]["error"]["code"] == INVALID_PARAMS and "colour" in out["bad"]["error"]["message"]
    assert out["after"] == {"error": None, "result": [1, 410, 469, 347]}
