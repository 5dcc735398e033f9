"""The MessagePack-RPC server as a real process on the bundled model: concurrency, raw protocol, errors.

One server process serves the whole module; every test that disturbs it checks afterwards that the
others are still served and that the KV pool is entirely free once idle.
"""

import asyncio
import contextlib
import os
import re
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import msgpack
import pytest

from minisarathi.client import AsyncClient, Client, RPCError
from minisarathi.sampling_params import SamplingParams
from minisarathi.server.protocol import (
    ABORTED,
    CHUNK_NOTIFICATION,
    INVALID_MESSAGE,
    INVALID_PARAMS,
    OVERLOADED,
    PROMPT_TOO_LONG,
    UNKNOWN_METHOD,
)

REPO = Path(__file__).resolve().parents[2]
NUM_KV_BLOCKS = 512
MAX_INFLIGHT = 8  # per connection, small so the overloaded test is cheap
MAX_MESSAGE_BYTES = 1 << 16
PROMPTS = [
    "Once upon a time",
    "Tom had a red",
    "Lily and Tom went to the park.",
    "The cat",
    "One day, a little",
    "Zoo",
    "She saw a big",
    "He liked to play with his toys and",
]


@contextlib.contextmanager
def launch_server(*extra_args: str, env: dict | None = None):
    """`python -m minisarathi serve` on a free TCP port and a Unix socket; SIGTERM at exit must give rc 0."""
    with tempfile.TemporaryDirectory() as tmp:
        unix_socket = os.path.join(tmp, "ms.sock")
        log_path = os.path.join(tmp, "server.log")
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "minisarathi",
                    "serve",
                    "--port",
                    "0",
                    "--unix-socket",
                    unix_socket,
                    "--log-level",
                    "WARNING",
                    *extra_args,
                ],
                cwd=REPO,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
            )
        try:
            port = _wait_for_port(proc, log_path)
            yield SimpleNamespace(port=port, unix_socket=unix_socket, proc=proc, log_path=log_path)
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            rc = proc.wait(timeout=60)
        assert rc == 0, Path(log_path).read_text()


def _wait_for_port(proc, log_path) -> int:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 1.0)
        if ready:
            line = proc.stdout.readline()
            if not line:
                break
            match = re.match(r"minisarathi serving on [\d.]+:(\d+)", line)
            if match:
                proc.stdout.readline()  # the Unix socket line follows
                return int(match.group(1))
    proc.kill()
    raise RuntimeError("server did not start:\n" + Path(log_path).read_text())


def wait_until_idle(server, timeout: float = 30.0, api_key: str | None = None) -> dict:
    """Poll stats until no request is held; the KV pool must then be entirely free."""
    with Client("127.0.0.1", server.port, api_key=api_key) as client:
        deadline = time.monotonic() + timeout
        while True:
            stats = client.stats()
            if stats["pending_requests"] == 0 and stats["running"] == 0 and stats["waiting"] == 0:
                break
            assert time.monotonic() < deadline, stats
            time.sleep(0.05)
    assert stats["kv_blocks_used"] == 0, stats
    return stats


def offline_greedy(prompts: list[str], max_tokens: list[int]):
    """The same requests through offline LLM.generate (default chunk size, all at once): greedy outputs must
    not depend on the batch mix, so the server's must match them token for token."""
    from minisarathi.llm import LLM

    outputs = LLM().generate(prompts, [SamplingParams(temperature=0, max_tokens=n) for n in max_tokens])
    return [out.outputs[0] for out in outputs]


@pytest.fixture(scope="module")
def server():
    with launch_server(
        "--num-kv-blocks",
        str(NUM_KV_BLOCKS),
        "--max-inflight-per-connection",
        str(MAX_INFLIGHT),
        "--max-message-bytes",
        str(MAX_MESSAGE_BYTES),
        "--chunk-size",
        "64",
    ) as s:
        yield s


class RawConnection:
    """The protocol with nothing but a socket and msgpack."""

    def __init__(self, server, unix: bool = False):
        if unix:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.connect(server.unix_socket)
        else:
            self.sock = socket.create_connection(("127.0.0.1", server.port))
        self.sock.settimeout(30)
        self.unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)

    def send(self, *messages):
        self.sock.sendall(b"".join(msgpack.packb(m) for m in messages))

    def receive(self):
        """The next message, or None when the server closed the connection."""
        while True:
            for message in self.unpacker:
                return message
            data = self.sock.recv(65536)
            if not data:
                return None
            self.unpacker.feed(data)

    def close(self):
        self.sock.close()


def test_64_concurrent_streams_match_offline_greedy(server):
    prompts = [f"{PROMPTS[i % len(PROMPTS)]}{' and' * (i // len(PROMPTS))}" for i in range(64)]
    max_tokens = [6 + (i * 5) % 13 for i in range(64)]
    expected = offline_greedy(prompts, max_tokens)

    async def one(prompt, n, use_unix):
        address = dict(unix_socket=server.unix_socket) if use_unix else dict(port=server.port)
        async with AsyncClient(**address) as client:
            stream = client.generate_stream(prompt, max_tokens=n, temperature=0)
            chunks = [chunk async for chunk in stream]
            return chunks, stream.result

    async def all_of_them():
        return await asyncio.gather(
            *[one(p, n, i % 2 == 1) for i, (p, n) in enumerate(zip(prompts, max_tokens))]
        )

    for (chunks, result), want in zip(asyncio.run(all_of_them()), expected):
        assert result.token_ids == want.token_ids
        assert result.text == want.text
        assert "".join(c.text for c in chunks) == result.text
        assert [t for c in chunks for t in c.token_ids] == result.token_ids
        assert result.finish_reason == want.finish_reason
        assert result.completion_tokens == len(want.token_ids)
    wait_until_idle(server)


def test_streams_sharing_a_connection_get_every_token_in_order(server):
    """Streams of one connection: the server writes each engine step's messages for a connection at once
    (_Connection.cork), chunks of different streams and final responses mixed; every stream still gets each of
    its tokens, in order, and its result after its last chunk, as offline greedy decoding gives them."""
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(8)]  # 8: the test server's in-flight limit
    max_tokens = [5 + 4 * i for i in range(8)]
    expected = offline_greedy(prompts, max_tokens)

    async def all_of_them():
        async with AsyncClient(port=server.port) as client:

            async def one(prompt, n):
                stream = client.generate_stream(prompt, max_tokens=n, temperature=0)
                return [chunk async for chunk in stream], stream.result

            return await asyncio.gather(*[one(p, n) for p, n in zip(prompts, max_tokens)])

    for (chunks, result), want in zip(asyncio.run(all_of_them()), expected):
        assert result.token_ids == want.token_ids and result.text == want.text
        assert [t for c in chunks for t in c.token_ids] == want.token_ids
        assert "".join(c.text for c in chunks) == want.text
    wait_until_idle(server)


def test_raw_msgpack_pipelining_out_of_order(server):
    conn = RawConnection(server)
    # A long generate first, then quick calls: the quick ones must not wait for it.
    conn.send(
        [0, 10, "generate", [{"prompt": "Once upon a time", "max_tokens": 40, "temperature": 0}]],
        [0, 11, "health", []],
        [0, 12, "tokenize", ["Once upon a time"]],
        [0, 13, "generate", [{"prompt": "Zoo", "max_tokens": 2, "temperature": 0, "stream": True}]],
        [0, 14, "model_info", []],
    )
    responses, chunks = {}, []
    order = []
    while len(responses) < 5:
        message = conn.receive()
        if message[0] == 2:
            assert message[1] == CHUNK_NOTIFICATION and message[2][0] == 13
            chunks.append(message[2][1])
        else:
            kind, msgid, error, result = message
            assert kind == 1 and error is None, message
            responses[msgid] = result
            order.append(msgid)
    assert order[-1] == 10 and order.index(13) < order.index(10)  # out of order: the long one last
    assert responses[11]["status"] == "ok"
    assert responses[12][0] == 1  # BOS
    assert responses[14]["vocab_size"] == 512
    assert responses[14]["weight_format"] == "float32" and responses[14]["weight_bytes"] > 4 * 260_000
    assert "".join(c["text"] for c in chunks) == responses[13]["text"]
    assert responses[10]["completion_tokens"] == 40 and responses[10]["finish_reason"] == "length"
    conn.send([0, 15, "detokenize", [responses[12]]])
    assert conn.receive() == [1, 15, None, "Once upon a time"]
    conn.close()


def test_abort_mid_stream(server):
    conn = RawConnection(server, unix=True)
    conn.send(
        [
            0,
            1,
            "generate",
            [
                {
                    "prompt": "Once upon a time",
                    "max_tokens": 400,
                    "ignore_eos": True,
                    "temperature": 0,
                    "stream": True,
                }
            ],
        ]
    )
    first = conn.receive()
    assert first[:2] == [2, CHUNK_NOTIFICATION]
    conn.send([0, 2, "abort", [1]])
    results = {}
    while len(results) < 2:
        message = conn.receive()
        if message[0] == 1:
            results[message[1]] = message
    assert results[2][2] is None and results[2][3] is True
    assert results[1][2]["code"] == ABORTED
    conn.send([0, 3, "abort", [1]])  # already gone
    assert conn.receive() == [1, 3, None, False]
    conn.close()
    wait_until_idle(server)


def test_disconnect_mid_stream_frees_the_request(server):
    with Client("127.0.0.1", server.port) as client:
        stream = client.generate_stream("Tom had a red", max_tokens=400, ignore_eos=True, temperature=0)
        next(iter(stream))
    stats = wait_until_idle(server)
    assert stats["connections"] == 1  # just the one asking


def test_stream_closed_early_by_the_client_aborts(server):
    with Client("127.0.0.1", server.port) as client:
        with client.generate_stream("Tom had a red", max_tokens=400, ignore_eos=True) as stream:
            next(iter(stream))
        assert client.generate("Zoo", max_tokens=3, temperature=0).completion_tokens == 3
    wait_until_idle(server)


def test_stream_closed_before_reading_aborts_at_once(server):
    with Client("127.0.0.1", server.port) as client:
        client.generate_stream("Tom had a red", max_tokens=400, ignore_eos=True).close()
        with client.generate_stream("Tom had a red", max_tokens=400, ignore_eos=True):
            pass
        assert client.stats()["pending_requests"] == 0  # aborted, not left generating 400 tokens
        assert client.generate("Zoo", max_tokens=3, temperature=0).completion_tokens == 3
    wait_until_idle(server)


@pytest.mark.parametrize(
    "garbage",
    [
        b"\xc1",  # a byte msgpack never uses
        b"\xdd\xff\xff\xff\xff",  # array32 header claiming 4 billion elements
        b"\xdb\xff\xff\xff\xff"
        + b"x" * (3 * MAX_MESSAGE_BYTES),  # str32 claiming 4 GiB, then more than the limit
    ],
    ids=["invalid-byte", "huge-array-header", "huge-string-header"],
)
def test_malformed_bytes_get_an_error_and_a_close(server, garbage):
    busy = Client("127.0.0.1", server.port)
    stream = busy.generate_stream("Once upon a time", max_tokens=30, temperature=0)
    conn = RawConnection(server)
    conn.sock.sendall(garbage)
    kind, method, params = conn.receive()  # no msgid to answer: an "error" notification
    assert (kind, method, params[0]["code"]) == (2, "error", INVALID_MESSAGE)
    assert conn.receive() is None  # then the server closed it
    conn.close()
    assert len(list(stream)) > 0 and stream.result.completion_tokens == 30  # others carry on
    busy.close()
    wait_until_idle(server)


def test_a_client_still_sending_after_a_bad_message_is_not_reset(server):
    """On a bad message the server answers and closes, reading and dropping what the client still sends first
    (bounded): a socket closed with unread input is reset, so a client still sending (the rest of an oversized
    message, say) got a reset from its send instead of the error, and a reading one a reset after the
    error."""
    conn = RawConnection(server)
    conn.sock.sendall(b"\xc1")  # a byte msgpack never uses
    time.sleep(0.3)  # answered by now
    for _ in range(3):  # the client is still sending
        conn.sock.sendall(b"x" * 1000)
        time.sleep(0.1)
    kind, method, params = conn.receive()
    assert (kind, method, params[0]["code"]) == (2, "error", INVALID_MESSAGE)
    assert conn.receive() is None  # the end of the stream, not a reset
    conn.close()


@pytest.mark.parametrize(
    "message, msgid",
    [
        ([0, 5, "health"], 5),  # three elements
        ([0, 6, 42, []], 6),  # method not a string
        ([0, "seven", "health", []], None),  # msgid not an integer
        ([7, 8, "health", []], None),  # unknown message type
        ([False, 9, "health", []], None),  # a bool is not a message type
        ([1, 10, None, True], None),  # a response: the server sends no requests
        ({"method": "health"}, None),  # not an array
    ],
)
def test_wrong_message_shape_gets_an_error_and_a_close(server, message, msgid):
    conn = RawConnection(server)
    conn.send(message)
    error = conn.receive()
    if msgid is None:  # [2, "error", [error]]: a response needs a uint32 msgid
        assert error[:2] == [2, "error"] and error[2][0]["code"] == INVALID_MESSAGE
    else:
        assert error[:2] == [1, msgid] and error[2]["code"] == INVALID_MESSAGE and error[3] is None
    assert conn.receive() is None
    conn.close()
    with Client("127.0.0.1", server.port) as client:
        assert client.health()["status"] == "ok"


@pytest.mark.parametrize(
    "method, params, code, named",
    [
        ("generate", [{"prompt": "a", "max_tokens": "many"}], INVALID_PARAMS, "max_tokens"),
        ("generate", [{"prompt": "a", "colour": "red"}], INVALID_PARAMS, "colour"),
        ("generate", [{"prompt": ["a"]}], INVALID_PARAMS, "prompt"),
        ("generate", [{"prompt_token_ids": [1, 99999]}], INVALID_PARAMS, "prompt_token_ids"),
        ("generate", [{"prompt": "a", "top_p": 0}], INVALID_PARAMS, "top_p"),
        # refused by the engine's add_request, on its thread: the only way back to the client is the failure
        # callback
        (
            "generate",
            [{"prompt": "a", "logit_bias": {"99999": 1}}],
            INVALID_PARAMS,
            "logit_bias token id 99999",
        ),
        ("generate", [{"prompt": "a b " * 600}], PROMPT_TOO_LONG, "prompt"),
        ("generate", [42], INVALID_PARAMS, "params"),
        ("generate", [{"prompt": "a"}, {"prompt": "b"}], INVALID_PARAMS, "params"),
        ("tokenize", [42], INVALID_PARAMS, "text"),
        ("detokenize", [[1, -1]], INVALID_PARAMS, "token_ids"),
        ("abort", ["x"], INVALID_PARAMS, "msgid"),
        ("launch_rockets", [], UNKNOWN_METHOD, "launch_rockets"),
    ],
)
def test_bad_calls_get_the_documented_error_and_the_connection_stays(server, method, params, code, named):
    with Client("127.0.0.1", server.port) as client:
        with pytest.raises(RPCError) as info:
            client.call(method, *params)
        assert info.value.code == code and named in info.value.message
        assert client.generate("Zoo", max_tokens=2).completion_tokens == 2  # same connection still works
    wait_until_idle(server)


def test_our_clients_raise_the_servers_error_notification(server):
    too_big = "Once upon a time " * (MAX_MESSAGE_BYTES // 8)
    for call in (lambda c: c.generate(too_big), lambda c: list(c.generate_stream(too_big))):
        with Client("127.0.0.1", server.port) as client:
            with pytest.raises(RPCError) as info:
                call(client)
            assert info.value.code == INVALID_MESSAGE and "size limit" in info.value.message

    async def run():
        async with AsyncClient("127.0.0.1", server.port) as client:
            await client.generate(too_big)

    with pytest.raises(RPCError) as info:
        asyncio.run(run())
    assert info.value.code == INVALID_MESSAGE


def test_too_many_in_flight_on_one_connection_is_overloaded(server):
    conn = RawConnection(server)
    n = MAX_INFLIGHT + 3
    conn.send(*[[0, i, "generate", [{"prompt": "Zoo", "max_tokens": 20}]] for i in range(n)])
    errors = {}
    for _ in range(n):
        kind, msgid, error, result = conn.receive()
        errors[msgid] = None if error is None else error["code"]
    assert sorted(errors) == list(range(n))
    assert [errors[i] for i in range(MAX_INFLIGHT)] == [None] * MAX_INFLIGHT
    assert [errors[i] for i in range(MAX_INFLIGHT, n)] == [OVERLOADED] * 3
    conn.close()
    wait_until_idle(server)


def test_stats_report_engine_and_server_figures(server):
    with Client("127.0.0.1", server.port) as client:
        client.generate("Once upon a time", max_tokens=5)
        stats = client.stats()
    for key in (
        "running",
        "waiting",
        "kv_blocks_used",
        "kv_usage",
        "prefix_cache_hit_rate",
        "throughput_tokens_per_s",
        "connections",
        "pending_requests",
    ):
        assert key in stats
    assert stats["kv_blocks_total"] == NUM_KV_BLOCKS and stats["tokens_generated"] >= 5


def test_stats_summarize_the_steps_since_a_step(server):
    """stats with steps_since: the summary of the engine's steps from there on, each step counted once by
    kind; what bench/hostile_clients.py reports for the server during a scenario."""
    with Client("127.0.0.1", server.port) as client:
        first = client.stats()["steps"]
        client.generate("Once upon a time", max_tokens=6, temperature=0, ignore_eos=True)
        stats = client.call("stats", {"steps_since": first})
        assert client.call("stats", {"steps_since": stats["steps"]})["step_times"] == {"steps": 0}
        with pytest.raises(RPCError, match="steps_since"):
            client.call("stats", {"steps_since": -1})
    summary = stats["step_times"]
    # one prefill step (it samples the first token), then one decode step per token, one sequence each
    assert summary["steps"] == stats["steps"] - first == 6
    assert summary["prefill"][0] == 1 and summary["decode_by_num_seqs"]["1"][0] == 5
    assert 0 < summary["p50_ms"] <= summary["p90_ms"] <= summary["p99_ms"] <= summary["max_ms"]


def test_logprobs_and_timing_fields(server):
    with Client("127.0.0.1", server.port) as client:
        result = client.generate("Once upon a time", max_tokens=4, temperature=0, logprobs=2)
    assert len(result.logprobs) == 4
    for token_id, position in zip(result.token_ids, result.logprobs):
        assert token_id in [entry["token_id"] for entry in position]
        assert all(entry["logprob"] <= 0 for entry in position)
    assert 0 <= result.extra["ttft_s"] <= result.extra["e2e_s"]


def test_priority_field_is_taken(server):
    with Client("127.0.0.1", server.port) as client:
        low = client.generate("Tom had a red", max_tokens=6, temperature=0, priority=5)
        high = client.generate("Tom had a red", max_tokens=6, temperature=0, priority=-5)
        with pytest.raises(RPCError, match="priority"):
            client.generate("Tom had a red", max_tokens=6, priority="urgent")
    assert low.token_ids == high.token_ids and len(low.token_ids) == 6


def test_prompt_token_ids_match_text_prompt(server):
    with Client(unix_socket=server.unix_socket) as client:
        ids = client.tokenize("Tom had a red")
        by_ids = client.generate(ids, max_tokens=10, temperature=0)
        by_text = client.generate("Tom had a red", max_tokens=10, temperature=0)
    assert by_ids.token_ids == by_text.token_ids and by_ids.prompt_tokens == len(ids)


def test_a_gguf_file_is_served_as_offline_greedy(tmp_path):
    import importlib.util

    from minisarathi.llm import LLM

    pytest.importorskip("gguf")
    spec = importlib.util.spec_from_file_location("make", REPO / "tests" / "golden" / "make_kquant_gguf.py")
    make = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make)
    path = str(make.write(tmp_path, "kquant-q4_k_m.gguf"))  # a random model: not stories260K's tokens
    with launch_server(path) as s, Client("127.0.0.1", s.port) as client:
        got = client.generate("Once upon a time", max_tokens=32, temperature=0)
    params = SamplingParams(temperature=0, max_tokens=32)
    want = LLM(path).generate(["Once upon a time"], params)[0].outputs[0]
    assert (got.text, got.token_ids) == (want.text, want.token_ids) and len(want.token_ids) == 32
    assert want.token_ids != LLM().generate(["Once upon a time"], params)[0].outputs[0].token_ids
