"""A key's quota pays for what a request costs, on both doors: every prompt x n is a request, an aborted
request pays for what the engine generated, a refused one costs nothing, and a chat request without
max_tokens fits the key (a real server process)."""

import asyncio
import importlib.util
import json
import socket
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_server import launch_server
from test_server_keys import http_port, post

from minisarathi.client import AsyncClient, Client, RPCError
from minisarathi.server.auth import add_key

pytestmark = pytest.mark.skipif(not importlib.util.find_spec("aiohttp"), reason="the http extra is needed")
TEMPLATE = Path(__file__).resolve().parents[1] / "golden" / "chat_templates" / "chatml.jinja"
BODY = {"model": "stories260K", "max_tokens": 4}


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.toml"
    secrets = {
        "many": add_key(path, "many", rpm=5, concurrent=4),
        "capped": add_key(path, "capped", max_tokens=20),
        "lean": add_key(path, "lean", tpm=300),
        "dropper": add_key(path, "dropper", tpm=20000),
        "refused": add_key(path, "refused", rpm=1),
    }
    with launch_server("--keys-file", str(path), "--http-port", "0", "--chat-template", str(TEMPLATE)) as s:
        s.secrets, s.http_port = secrets, http_port(s)
        yield s


def key_stats(server, name: str) -> dict:
    with Client("127.0.0.1", server.port, api_key=server.secrets["many"], timeout=60) as c:
        return c.stats()["keys"][name]


def test_every_prompt_times_n_is_a_request(keyed):
    many = keyed.secrets["many"]
    status, _, error = post(keyed.http_port, "/v1/completions", {**BODY, "prompt": ["a", "b"] * 3}, many)
    assert status == 400 and "counts as 6 requests" in error["error"]["message"], error
    status, _, error = post(
        keyed.http_port, "/v1/completions", {**BODY, "prompt": ["a", "b", "c", "d", "e"]}, many
    )
    assert status == 400 and "concurrent requests (4)" in error["error"]["message"], error
    status, _, result = post(keyed.http_port, "/v1/completions", {**BODY, "prompt": ["a", "b"], "n": 2}, many)
    assert status == 200 and len(result["choices"]) == 4
    assert key_stats(keyed, "many")["requests"] == 4
    status, _, _ = post(keyed.http_port, "/v1/completions", {**BODY, "prompt": ["a", "b"]}, many)
    assert status == 429  # 4 of the 5 a minute were taken by the first
    status, _, error = post(keyed.http_port, "/v1/completions", {**BODY, "prompt": ["a"] * 65}, many)
    assert status == 400 and "the limit is 64" in error["error"]["message"], error


def test_a_chat_without_max_tokens_fits_the_key(keyed):
    body = {"model": "stories260K", "messages": [{"role": "user", "content": "Tell me a story"}]}
    status, _, result = post(keyed.http_port, "/v1/chat/completions", body, keyed.secrets["capped"])
    assert status == 200, result
    assert result["usage"]["completion_tokens"] <= 20
    status, _, result = post(keyed.http_port, "/v1/chat/completions", body, keyed.secrets["lean"])
    assert status == 200, result
    usage = result["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] <= 300


def test_an_engine_refusal_costs_the_key_nothing(keyed):
    refused = keyed.secrets["refused"]
    with Client("127.0.0.1", keyed.port, api_key=refused, timeout=60) as c:
        vocab = c.model_info()["vocab_size"]
        for _ in range(3):  # the engine refuses a logit_bias id past the vocabulary, after admission
            with pytest.raises(RPCError, match="logit_bias"):
                c.generate("Zoo", max_tokens=2, logit_bias={vocab + 5: 1.0})
        assert c.generate("Zoo", max_tokens=2).completion_tokens == 2  # rpm=1: its one request is still there
    stats = key_stats(keyed, "refused")
    assert stats["prompt_tokens"] == len(tokens_of(keyed, "Zoo")) and stats["inflight"] == 0


def tokens_of(server, text: str) -> list[int]:
    with Client("127.0.0.1", server.port, api_key=server.secrets["many"], timeout=60) as c:
        return c.tokenize(text)


def raw_http(port: int, body: dict, key: str) -> socket.socket:
    """A non-streamed completion sent on a bare socket, which the caller closes before the answer."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Authorization: Bearer {key}\r\nContent-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    return sock


def wait_for(predicate, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError("timed out")


def test_a_dropped_request_pays_for_what_was_generated(keyed):
    """Unstreamed, a request delivers nothing before its end: dropping it just before used to be a full
    refund of every generated token, on both doors."""
    dropper = keyed.secrets["dropper"]
    sock = raw_http(
        keyed.http_port, {**BODY, "prompt": "Once", "max_tokens": 1900, "ignore_eos": True}, dropper
    )
    time.sleep(0.15)  # some tokens generated, not all (the model's context is 512)
    sock.close()
    stats = wait_for(lambda: (s := key_stats(keyed, "dropper"))["inflight"] == 0 and s)
    assert stats["completion_tokens"] > 0, stats
    http_generated = stats["completion_tokens"]

    async def drop_msgpack():
        client = AsyncClient("127.0.0.1", keyed.port, api_key=dropper)
        await client.__aenter__()
        task = asyncio.ensure_future(client.generate("Once", max_tokens=1900, ignore_eos=True))
        await asyncio.sleep(0.15)
        await client.__aexit__(None, None, None)  # the connection closes under the request
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(drop_msgpack())
    stats = wait_for(lambda: (s := key_stats(keyed, "dropper"))["inflight"] == 0 and s)
    assert stats["completion_tokens"] > http_generated, stats


def test_the_quota_and_queue_refuse_before_any_tokenizing():
    """An over-quota flood of text prompts costs the event loop no tokenizing."""
    from minisarathi.sampling_params import SamplingParams
    from minisarathi.server.http import HttpDoor
    from minisarathi.server.openai_api import GenerationRequest, OpenAIError
    from minisarathi.server.protocol import RATE_LIMITED, RPCError

    tokenized = []

    def precheck(key, max_tokens, tokens, requests, queued):
        assert (tokens, requests, queued) == (3 + 3 * 4, 3, 3)
        raise RPCError(RATE_LIMITED, "over the quota", retry_after_s=1.0)

    async def encode_prompt(text, name, add_special_tokens):
        tokenized.append(text)
        return [1]

    hub = SimpleNamespace(precheck=precheck, encode_prompt=encode_prompt, accepting=True)
    door = SimpleNamespace(hub=hub, _fit_max_tokens=lambda call: None)
    door._encode_prompts = lambda parsed, param, special: HttpDoor._encode_prompts(
        door, parsed, param, special
    )
    request = GenerationRequest(
        [None] * 3, ["a", "b", "c"], SamplingParams(max_tokens=4), False, False, None, "m"
    )
    call = SimpleNamespace(request=request, key=object())
    with pytest.raises(OpenAIError) as info:
        asyncio.run(HttpDoor._prepare(door, call, "prompt", True))
    assert info.value.status == 429 and tokenized == []
