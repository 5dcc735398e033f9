"""The OpenAI-compatible HTTP door as a real server process, through the official `openai` SDK and raw HTTP:
results equal offline LLM.generate, streams equal non-streamed results, bad input gets the right status and
an OpenAI error naming the field (and the server keeps serving), a disconnected stream frees its KV blocks,
and the Prometheus metrics equal what a known workload implies.
"""

import asyncio
import contextlib
import http.client
import itertools
import json
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("aiohttp")
pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from minisarathi.client import Client  # noqa: E402
from minisarathi.llm import LLM  # noqa: E402
from minisarathi.paths import default_model_dir  # noqa: E402
from minisarathi.sampling_params import SamplingParams  # noqa: E402
from minisarathi.server.chat_template import load_chat_template  # noqa: E402
from minisarathi.tokenizer import Tokenizer  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
TEMPLATE = REPO / "tests" / "golden" / "chat_templates" / "chatml.jinja"
API_KEY = "test-key-123"
MAX_BODY = 1 << 16
MAX_N = 4
PROMPTS = ["Once upon a time", "Tom had a red", "Lily and Tom went to the park.", "The cat"]


@contextlib.contextmanager
def launch(*args: str, model_dir: Path | None = None):
    """`python -m minisarathi serve` with the given flags; yields the addresses it prints, by kind."""
    with tempfile.TemporaryDirectory() as tmp:
        log_path = os.path.join(tmp, "server.log")
        key_file = os.path.join(tmp, "key")
        Path(key_file).write_text(API_KEY)
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "minisarathi",
                    "serve",
                    *([str(model_dir)] if model_dir else []),
                    "--port",
                    "0",
                    "--api-key-file",
                    key_file,
                    "--log-level",
                    "INFO",
                    *args,
                ],
                cwd=REPO,
                stdout=subprocess.PIPE,
                stderr=log,
                env={**os.environ, "PYTHONPATH": str(REPO)},
            )
        try:
            yield SimpleNamespace(proc=proc, log_path=log_path, **_addresses(proc, log_path, args))
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            rc = proc.wait(timeout=60)
        assert rc == 0, Path(log_path).read_text()


def _addresses(proc, log_path, args) -> dict:
    wanted = ("--no-msgpack" not in args) + ("--http-port" in args) + ("--metrics-port" in args)
    found, output = {}, b""
    deadline = time.monotonic() + 120
    while len(found) < wanted and time.monotonic() < deadline:
        if not select.select([proc.stdout], [], [], 1.0)[0]:
            continue
        piece = os.read(proc.stdout.fileno(), 4096)  # unbuffered: select stays truthful
        if not piece:
            break
        output += piece
        found = {}
        http_kinds = [
            k
            for k, flag in (("http_port", "--http-port"), ("metrics_port", "--metrics-port"))
            if flag in args
        ]
        for match in re.finditer(rb"minisarathi serving on (http://)?[\d.]+:(\d+)", output):
            kind = http_kinds.pop(0) if match.group(1) else "msgpack_port"
            found[kind] = int(match.group(2))
    if len(found) < wanted:
        proc.kill()
        raise RuntimeError("server did not start:\n" + Path(log_path).read_text())
    return found


@pytest.fixture(scope="module")
def model_with_template(tmp_path_factory):
    folder = tmp_path_factory.mktemp("model")
    for f in default_model_dir().iterdir():
        shutil.copy(f, folder / f.name)
    shutil.copy(TEMPLATE, folder / "chat_template.jinja")
    return folder


@pytest.fixture(scope="module")
def server(model_with_template):
    with launch(
        "--http-port",
        "0",
        "--served-model-name",
        "stories260K",
        "--num-kv-blocks",
        "256",
        "--chunk-size",
        "64",
        "--max-message-bytes",
        str(MAX_BODY),
        "--max-n",
        str(MAX_N),
        model_dir=model_with_template,
    ) as s:
        s.client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{s.http_port}/v1", api_key=API_KEY, max_retries=0
        )
        yield s


def wait_until_idle(server, timeout: float = 30.0) -> dict:
    """Poll the msgpack door's stats (the same engine) until nothing is held: the KV pool must be free."""
    with Client("127.0.0.1", server.msgpack_port, api_key=API_KEY) as client:
        deadline = time.monotonic() + timeout
        while True:
            stats = client.stats()
            if stats["pending_requests"] == 0 and stats["running"] == 0 and stats["waiting"] == 0:
                break
            assert time.monotonic() < deadline, stats
            time.sleep(0.05)
    assert stats["kv_blocks_used"] == 0, stats
    return stats


def offline(prompts, **params):
    return [out.outputs[0] for out in LLM().generate(prompts, SamplingParams(**params))]


def raw(server, method: str, path: str, body=None, headers=None, port=None, source="127.0.0.1"):
    """(status, headers, JSON body) of one plain HTTP request, sent from the address `source`."""
    conn = http.client.HTTPConnection(
        "127.0.0.1", port or server.http_port, timeout=30, source_address=(source, 0)
    )
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    conn.request(
        method,
        path,
        body=data,
        headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json", **(headers or {})},
    )
    response = conn.getresponse()
    payload = response.read()
    conn.close()
    return response.status, dict(response.getheaders()), json.loads(payload) if payload else None


# ------------------------------------------------------------------------------------------------ results


def test_completions_greedy_equal_llm_generate_streamed_or_not(server):
    expected = offline(PROMPTS, temperature=0, max_tokens=24)
    for prompt, want in zip(PROMPTS, expected):
        result = server.client.completions.create(
            model="stories260K", prompt=prompt, max_tokens=24, temperature=0
        )
        assert result.object == "text_completion" and result.model == "stories260K"
        assert result.choices[0].text == want.text
        assert result.choices[0].finish_reason == want.finish_reason
        assert result.usage.completion_tokens == len(want.token_ids)
        assert result.usage.prompt_tokens == len(
            Tokenizer.from_pretrained(default_model_dir()).encode(prompt)
        )
        assert result.usage.total_tokens == result.usage.prompt_tokens + result.usage.completion_tokens
        chunks = list(
            server.client.completions.create(
                model="stories260K", prompt=prompt, max_tokens=24, temperature=0, stream=True
            )
        )
        assert "".join(c.choices[0].text for c in chunks) == want.text
        assert chunks[-1].choices[0].finish_reason == want.finish_reason
        assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
        assert len({c.id for c in chunks}) == 1
    prioritized = server.client.completions.create(
        model="stories260K", prompt=PROMPTS[0], max_tokens=24, temperature=0, extra_body={"priority": -2}
    )
    assert prioritized.choices[0].text == expected[0].text
    wait_until_idle(server)


def test_completions_prompt_forms_and_multiple_prompts(server):
    ids = Tokenizer.from_pretrained(default_model_dir()).encode(PROMPTS[1])
    want = offline([PROMPTS[0], PROMPTS[1]], temperature=0, max_tokens=8)
    result = server.client.completions.create(
        model="stories260K", prompt=[PROMPTS[0], PROMPTS[1]], max_tokens=8, temperature=0
    )
    assert [c.index for c in result.choices] == [0, 1]
    assert [c.text for c in result.choices] == [w.text for w in want]
    by_ids = server.client.completions.create(model="stories260K", prompt=ids, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == want[1].text
    nested = server.client.completions.create(
        model="stories260K", prompt=[ids, ids], max_tokens=8, temperature=0
    )
    assert [c.text for c in nested.choices] == [want[1].text] * 2
    assert nested.usage.prompt_tokens == 2 * len(ids)


def test_chat_greedy_equals_llm_generate_on_the_rendered_prompt(server, model_with_template):
    messages = [{"role": "user", "content": "Tell me a story."}]
    template = load_chat_template(model_with_template)
    tokenizer = Tokenizer.from_pretrained(default_model_dir())
    prompt_ids = tokenizer.encode(template.render(messages, True), add_special_tokens=False)
    want = offline([prompt_ids], temperature=0, max_tokens=20)[0]
    result = server.client.chat.completions.create(
        model="stories260K", messages=messages, max_completion_tokens=20, temperature=0
    )
    assert result.object == "chat.completion"
    assert result.choices[0].message.role == "assistant"
    assert result.choices[0].message.content == want.text
    assert result.usage.prompt_tokens == len(prompt_ids)
    chunks = list(
        server.client.chat.completions.create(
            model="stories260K",
            messages=messages,
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.token_ids)
    assert chunks[-2].choices[0].finish_reason == want.finish_reason
    assert all(c.object == "chat.completion.chunk" for c in chunks)


def test_n2_stop_strings_and_seeds(server):
    greedy = server.client.completions.create(
        model="stories260K", prompt="Once upon a time", n=2, max_tokens=16, temperature=0
    )
    want = offline(["Once upon a time"], temperature=0, max_tokens=16)[0]
    assert [c.index for c in greedy.choices] == [0, 1] and {c.text for c in greedy.choices} == {want.text}
    assert greedy.usage.completion_tokens == 2 * len(want.token_ids)

    def sampled():
        result = server.client.completions.create(
            model="stories260K", prompt="Once upon a time", n=2, max_tokens=24, temperature=1.0, seed=11
        )
        return [c.text for c in result.choices]

    first = sampled()
    assert first == sampled()  # seeded: reproducible
    assert first[0] != first[1]  # each choice its own random stream
    chunks = list(
        server.client.completions.create(
            model="stories260K",
            prompt="Once upon a time",
            n=2,
            max_tokens=24,
            temperature=1.0,
            seed=11,
            stream=True,
        )
    )
    assert ["".join(c.choices[0].text for c in chunks if c.choices[0].index == i) for i in (0, 1)] == first

    stop_want = offline(["Once upon a time"], temperature=0, max_tokens=40, stop=["Lily"])[0]
    assert stop_want.finish_reason == "stop"
    stopped = server.client.completions.create(
        model="stories260K", prompt="Once upon a time", max_tokens=40, temperature=0, stop="Lily"
    )
    assert stopped.choices[0].text == stop_want.text and "Lily" not in stopped.choices[0].text
    assert stopped.choices[0].finish_reason == "stop"
    chat = server.client.chat.completions.create(
        model="stories260K",
        messages=[{"role": "user", "content": "Hi"}],
        n=2,
        max_tokens=12,
        temperature=0,
        stop=["."],
    )
    assert len(chat.choices) == 2 and chat.choices[0].message.content == chat.choices[1].message.content
    assert "." not in chat.choices[0].message.content
    wait_until_idle(server)


def test_logit_bias(server):
    forced = server.client.completions.create(
        model="stories260K",
        prompt="Once upon a time",
        max_tokens=4,
        temperature=0,
        logit_bias={"400": 100},
        logprobs=0,
    )
    assert forced.choices[0].logprobs.tokens == [" do"] * 4  # "▁do" after a word, not decoded alone ("do")
    assert "".join(forced.choices[0].logprobs.tokens) == forced.choices[0].text
    want = offline(["Once upon a time"], temperature=0, max_tokens=4, logit_bias={400: 100})[0]
    assert forced.choices[0].text == want.text


def test_logprobs_match_llm_generate(server, model_with_template):
    want = offline(["Once upon a time"], temperature=0, max_tokens=6, logprobs=2)[0]
    result = server.client.completions.create(
        model="stories260K", prompt="Once upon a time", max_tokens=6, temperature=0, logprobs=2
    )
    lp = result.choices[0].logprobs
    assert len(lp.tokens) == len(want.token_ids) == len(lp.token_logprobs) == len(lp.top_logprobs)
    for token_id, position, token, token_lp, top in zip(
        want.token_ids, want.logprobs, lp.tokens, lp.token_logprobs, lp.top_logprobs
    ):
        assert token == position[token_id].decoded_token
        assert token_lp == pytest.approx(
            position[token_id].logprob, abs=1e-4
        )  # float32 logits; the chunking differs
        assert {position[t].decoded_token for t in position if position[t].rank <= 2} <= set(top)
    # each token's text in context ("▁there" is " there"): they make up the text, and their offsets index it
    text = result.choices[0].text
    assert "".join(lp.tokens) == text and any(t.startswith(" ") for t in lp.tokens)
    assert [text[o : o + len(t)] for o, t in zip(lp.text_offset, lp.tokens)] == lp.tokens
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]
    streamed = list(
        server.client.completions.create(
            model="stories260K",
            prompt="Once upon a time",
            max_tokens=6,
            temperature=0,
            logprobs=2,
            stream=True,
        )
    )
    assert [t for c in streamed for t in c.choices[0].logprobs.tokens] == lp.tokens
    assert [o for c in streamed for o in c.choices[0].logprobs.text_offset] == lp.text_offset

    messages = [{"role": "user", "content": "Hi"}]
    template = load_chat_template(model_with_template)
    ids = Tokenizer.from_pretrained(default_model_dir()).encode(
        template.render(messages, True), add_special_tokens=False
    )
    chat_want = offline([ids], temperature=0, max_tokens=5, logprobs=3)[0]
    chat = server.client.chat.completions.create(
        model="stories260K", messages=messages, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == len(chat_want.token_ids)
    assert "".join(entry.token for entry in content) == chat.choices[0].message.content
    assert bytes(b for entry in content for b in entry.bytes).decode() == chat.choices[0].message.content
    for entry, token_id, position in zip(content, chat_want.token_ids, chat_want.logprobs):
        assert entry.token == position[token_id].decoded_token
        assert entry.logprob == pytest.approx(
            position[token_id].logprob, abs=1e-4
        )  # float32 logits; the chunking differs
        assert bytes(entry.bytes).decode() == entry.token
        ranked = sorted((lp for lp in position.values() if lp.rank <= 3), key=lambda lp: lp.rank)
        assert [t.token for t in entry.top_logprobs] == [lp.decoded_token for lp in ranked]


def test_models_health_ready_metrics_and_request_id(server):
    models = server.client.models.list()
    assert [m.id for m in models.data] == ["stories260K"]
    assert models.data[0].model_dump()["weight_format"] == "float32"
    assert server.client.models.retrieve("stories260K").model_dump() == models.data[0].model_dump()
    status, _, body = raw(server, "GET", "/v1/models/gpt-5")
    assert status == 404 and body["error"]["code"] == "model_not_found"
    status, headers, body = raw(server, "GET", "/v1/completions")  # a POST-only path
    assert status == 405 and headers["Allow"] == "POST" and body["error"]["type"] == "invalid_request_error"
    for path in ("/health", "/ready"):
        status, _, body = raw(server, "GET", path, headers={"Authorization": ""})
        assert status == 200 and body["status"] in ("ok", "ready")
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
    conn.request("GET", "/metrics")
    response = conn.getresponse()
    assert response.status == 200 and b"minisarathi:num_requests_running" in response.read()
    status, headers, body = raw(
        server,
        "POST",
        "/v1/completions",
        {"prompt": "Zoo", "max_tokens": 2},
        headers={"X-Request-Id": "my-id-42"},
    )
    assert status == 200 and headers["X-Request-Id"] == "my-id-42" and body["id"] == "my-id-42"
    assert "my-id-42" in Path(server.log_path).read_text()


# ------------------------------------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    "path, body, status, param",
    [
        ("/v1/completions", b"{not json", 400, None),
        ("/v1/completions", [1, 2], 400, None),
        ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
        ("/v1/completions", {"prompt": 5}, 400, "prompt"),
        ("/v1/completions", {"prompt": [1, 99999]}, 400, "prompt"),
        ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
        ("/v1/completions", {"prompt": "x", "n": MAX_N + 1}, 400, "n"),
        ("/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "stream"),
        ("/v1/completions", {"prompt": "x", "logprobs": 50}, 400, "logprobs"),
        ("/v1/completions", {"prompt": "x", "frobnicate": 1}, 400, "frobnicate"),
        ("/v1/completions", {"prompt": "x", "echo": True}, 400, "echo"),
        ("/v1/completions", {"prompt": "x", "priority": "high"}, 400, "priority"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"99999": 5}}, 400, "logit_bias"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"7": 500}}, 400, "logit_bias"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"99999": 5}, "stream": True}, 400, "logit_bias"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 10**9}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "model": "gpt-5"}, 404, "model"),
        ("/v1/completions", {"prompt": "x" * (MAX_BODY + 10)}, 413, None),
        ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}, 400, "messages[0].content"),
        ("/v1/chat/completions", {"messages": [{"content": "x"}]}, 400, "messages[0].role"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -1},
            400,
            "max_completion_tokens",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
            400,
            "top_logprobs",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
            400,
            "tools[0]",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"x": [[[[1]]]]}},
            400,
            "chat_template_kwargs",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "model": "nope"},
            404,
            "model",
        ),
        ("/v1/nothing", {}, 404, None),
        # the msgpack door's list bounds hold here too (ServerLimits: 16 stop strings, 1024 characters, 64
        # ids)
        ("/v1/completions", {"prompt": "x", "stop": ["s"] * 17}, 400, "stop"),
        ("/v1/completions", {"prompt": "x", "stop": "s" * 1025}, 400, "stop"),
        ("/v1/completions", {"prompt": "x", "stop_token_ids": [5] * 65}, 400, "stop_token_ids"),
        (
            "/v1/completions",
            {"prompt": "x", "logit_bias": {str(i): 1 for i in range(1025)}},
            400,
            "logit_bias",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "stop": ["s"] * 17},
            400,
            "stop",
        ),
        # JSON that parses but is no text, or parses only with Python's recursion: a 400, not a 500
        ("/v1/completions", b'{"prompt": "Once \\ud800 upon", "max_tokens": 2}', 400, None),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udfff"}]}', 400, None),
        ("/v1/completions", b"[" * 30000 + b"]" * 30000, 400, None),
    ],
)
def test_bad_input_gets_an_openai_error_naming_the_field(server, path, body, status, param):
    code, _, error = raw(server, "POST", path, body)
    assert code == status, error
    assert set(error["error"]) == {"message", "type", "param", "code"} and error["error"]["message"]
    assert error["error"]["param"] == param
    if param is not None and "[" not in param:
        assert param.split(".")[0] in error["error"]["message"]


@pytest.mark.parametrize(
    "body, says",
    [
        (b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", "integer of more than"),
        (b'{"prompt": "\xff\xfe x"}', "not UTF-8 text"),
        (b'{"prompt": "x", "max_tokens": }', "not valid JSON"),
    ],
    ids=["huge integer", "not utf-8", "not json"],
)
def test_body_errors_say_what_is_wrong_in_the_clients_terms(server, body, says):
    """No Python internals (how to raise Python's digit limit, codec names) in a client's error."""
    code, _, error = raw(server, "POST", "/v1/completions", body)
    message = error["error"]["message"]
    assert code == 400 and says in message, message
    assert not any(word in message for word in ("sys.", "codec", "utf-8'", "Python")), message


def test_auth_and_the_server_keeps_serving(server):
    # Each wrong key comes from an address of its own on the loopback: the per-address backoff a run of them
    # earns (docs/security.md) would space out the checks, and this module's later connections from 127.0.0.1.
    attempts = itertools.product(
        ({"Authorization": ""}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic x"}),
        (("POST", "/v1/completions"), ("GET", "/v1/models"), ("POST", "/v1/chat/completions")),
    )
    for i, (headers, (method, path)) in enumerate(attempts):
        status, _, error = raw(
            server, method, path, {"prompt": "x"}, headers=headers, source=f"127.0.1.{i + 1}"
        )
        assert status == 401 and error["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(
            base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="nope", max_retries=0
        ).models.list()  # one failure from 127.0.0.1: a turn 0.05 s later
    with pytest.raises(openai.BadRequestError):
        server.client.completions.create(model="stories260K", prompt="x", n=MAX_N + 1)
    with pytest.raises(openai.NotFoundError):
        server.client.completions.create(model="other", prompt="x")
    # still serving, KV pool untouched
    result = server.client.completions.create(model="stories260K", prompt="Zoo", max_tokens=3, temperature=0)
    assert result.choices[0].finish_reason == "length"
    wait_until_idle(server)


def test_chat_without_a_template_is_a_clear_400_and_a_full_queue_a_429():
    with launch(
        "--http-port", "0", "--num-kv-blocks", "64", "--no-msgpack", "--max-queued-requests", "1"
    ) as s:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{s.http_port}/v1", api_key=API_KEY, max_retries=0)
        with pytest.raises(openai.BadRequestError, match="no chat template"):
            client.chat.completions.create(model="stories260K", messages=[{"role": "user", "content": "Hi"}])
        long = client.completions.create(
            model="stories260K",
            prompt="Once upon a time",
            max_tokens=400,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        next(iter(long))  # it holds the one queue place
        status, headers, error = raw(s, "POST", "/v1/completions", {"prompt": "Zoo", "max_tokens": 2})
        assert (
            status == 429
            and error["error"]["code"] == "overloaded"
            and "queue is full" in error["error"]["message"]
        )
        long.close()
        deadline = time.monotonic() + 30
        while raw(s, "POST", "/v1/completions", {"prompt": "Zoo", "max_tokens": 2})[0] == 429:
            assert time.monotonic() < deadline  # the closed stream gave its place back
            time.sleep(0.05)
        assert (
            client.completions.create(model="stories260K", prompt="Zoo", max_tokens=2).choices[0].text
            is not None
        )


def test_sse_disconnect_frees_the_kv_pool(server):
    for _ in range(3):
        sock = socket.create_connection(("127.0.0.1", server.http_port))
        body = json.dumps(
            {
                "prompt": "Once upon a time",
                "max_tokens": 400,
                "ignore_eos": True,
                "stream": True,
                "temperature": 0,
            }
        ).encode()
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer "
            + API_KEY.encode()
            + b"\r\nContent-Length: "
            + str(len(body)).encode()
            + b"\r\n\r\n"
            + body
        )
        received = b""
        while received.count(b"data:") < 3:
            received += sock.recv(4096)
        assert b"200 OK" in received
        sock.close()  # mid-stream: 400 tokens would take far longer
    stats = wait_until_idle(server)
    assert stats["kv_blocks_used"] == 0
    assert "aborted: client disconnected" in Path(server.log_path).read_text()


def _unread_stream(port: int, body: dict) -> socket.socket:
    """An SSE request on a socket with a small receive buffer, whose caller does not read it (yet)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(30)
    sock.connect(("127.0.0.1", port))
    data = json.dumps({**body, "stream": True}).encode()
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    return sock


def test_an_unread_sse_stream_is_paused_then_resumed_or_aborted():
    """A stream its client does not read gives its batch slots back and stops growing in server memory; read
    again, it resumes and ends complete; left unread past --unread-timeout, it is aborted and frees its KV."""
    body = {"prompt": "Once upon a time", "max_tokens": 500, "n": 4, "ignore_eos": True, "temperature": 0}
    with launch("--http-port", "0", "--max-n", "4", "--unread-timeout", "3") as server:
        with Client("127.0.0.1", server.msgpack_port, api_key=API_KEY) as client:
            sock = _unread_stream(server.http_port, body)
            deadline = time.monotonic() + 30
            while client.stats()["paused"] == 0:
                assert time.monotonic() < deadline, "the unread stream was never paused"
                time.sleep(0.05)
            assert client.generate("Zoo", max_tokens=8, ignore_eos=True).completion_tokens == 8  # others run
            received = b""
            while not received.endswith(b"\r\n0\r\n\r\n"):  # the last chunk of a chunked body
                piece = sock.recv(1 << 16)
                assert piece, "the stream ended early"
                received += piece
            sock.close()
            assert b"data: [DONE]\n\n" in received
            assert client.stats()["resumed"] >= 1
            events = [json.loads(line[6:]) for line in received.split(b"\n") if line.startswith(b"data: {")]
            ends = {
                c["index"]: c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]
            }
            assert ends == {i: "length" for i in range(4)}

            sock = _unread_stream(server.http_port, body)  # never read: aborted after 3 s
            deadline = time.monotonic() + 30
            while client.stats()["unread_aborts"] == 0:
                assert time.monotonic() < deadline, "the unread stream was never aborted"
                time.sleep(0.1)
            sock.close()
        stats = wait_until_idle(server)
        assert stats["kv_blocks_used"] == 0
        assert "left its stream unread for 3s; aborting it" in Path(server.log_path).read_text()


def _post_raw(port: int, body: dict, request_id: str) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    data = json.dumps(body).encode()
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nX-Request-Id: "
        + request_id.encode()
        + b"\r\nAuthorization: Bearer "
        + API_KEY.encode()
        + b"\r\nContent-Length: "
        + str(len(data)).encode()
        + b"\r\n\r\n"
        + data
    )
    return sock


def test_a_request_aborted_before_its_first_output_is_logged_and_counted_and_ids_are_unique():
    with launch("--http-port", "0", "--max-num-seqs", "1", "--num-kv-blocks", "64") as s:
        long = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "temperature": 0}
        running = _post_raw(s.http_port, {**long, "stream": True}, "running")
        queued = _post_raw(s.http_port, long, "queued")  # max_num_seqs 1: it waits, no output yet
        with Client("127.0.0.1", s.msgpack_port, api_key=API_KEY) as client:
            deadline = time.monotonic() + 30
            while client.stats()["waiting"] == 0:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            # the id of a request in flight again: the client's error, named by its public id
            status, headers, error = raw(
                s,
                "POST",
                "/v1/completions",
                {"prompt": "Tom", "max_tokens": 2},
                headers={"X-Request-Id": "running"},
            )
            assert status == 400 and error["error"]["param"] == "X-Request-Id"
            assert "'running'" in error["error"]["message"] and "http:" not in error["error"]["message"]
            queued.close()
            running.close()
            deadline = time.monotonic() + 30
            while client.stats()["running"] + client.stats()["waiting"]:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        deadline = time.monotonic() + 10  # each handler reports once its cancellation has run
        while (
            len(
                re.findall(
                    r"(running|queued) door=\"http\".* finish_reason=\"abort\"", Path(s.log_path).read_text()
                )
            )
            < 2
        ):
            assert time.monotonic() < deadline, "no finished-request line for an aborted request"
            time.sleep(0.05)
        aborted = scrape(s.http_port)[("minisarathi:request_success_total", (("finished_reason", "abort"),))]
        assert aborted == 2


# ------------------------------------------------------------------------------------------------ metrics


def scrape(port) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    return {
        (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_metrics_equal_the_known_workload(server):
    tokenizer = Tokenizer.from_pretrained(default_model_dir())
    prompts, max_tokens = PROMPTS[:3], [5, 7, 9]
    prompt_tokens = [len(tokenizer.encode(p)) for p in prompts]
    # Steps that determine the cost model's first fit (made as the metrics are read), whatever ran before:
    # prefills of three lengths, and decodes.
    for prompt in ("Zoo", PROMPTS[0], PROMPTS[2]):
        server.client.completions.create(
            model="stories260K", prompt=prompt, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
        )
    wait_until_idle(server)
    before = scrape(server.http_port)
    for prompt, n in zip(prompts, max_tokens):
        server.client.completions.create(
            model="stories260K", prompt=prompt, max_tokens=n, temperature=0, extra_body={"ignore_eos": True}
        )
    stopped = server.client.completions.create(
        model="stories260K", prompt="Once upon a time", max_tokens=40, temperature=0, stop="Lily"
    )
    after = scrape(server.http_port)

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0) - before.get(key, 0)

    stop_tokens = stopped.usage.completion_tokens
    p = "minisarathi:"
    assert delta(p + "prompt_tokens_total") == sum(prompt_tokens) + stopped.usage.prompt_tokens
    assert delta(p + "generation_tokens_total") == sum(max_tokens) + stop_tokens
    assert delta(p + "request_success_total", finished_reason="length") == 3
    assert delta(p + "request_success_total", finished_reason="stop") == 1
    for name in (
        "time_to_first_token_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
        "request_prompt_tokens",
        "request_generation_tokens",
    ):
        assert delta(p + name + "_count") == 4, name
    assert delta(p + "inter_token_latency_seconds_count") == sum(n - 1 for n in max_tokens) + stop_tokens - 1
    assert delta(p + "request_generation_tokens_sum") == sum(max_tokens) + stop_tokens
    # every token computed in a step: the prompts (no prefix cache) and each fed-back generated token
    computed = (
        sum(prompt_tokens) + stopped.usage.prompt_tokens + sum(n - 1 for n in max_tokens) + stop_tokens - 1
    )
    assert delta(p + "iteration_tokens_total_sum") == computed
    assert after[(p + "num_requests_running", ())] == 0 and after[(p + "kv_cache_usage_perc", ())] == 0
    assert after[(p + "scheduler_token_budget", ())] == 64
    steps = delta(p + "iteration_tokens_total_count")  # the cost model's error, once it is fitted (10 steps)
    assert 0 < delta(p + "step_time_prediction_ratio_count") <= steps
    assert after[(p + "cost_model_coefficient_seconds", (("feature", "prefill_tokens"),))] >= 0
    # every metric the Grafana dashboard plots is exported (GPU memory only on CUDA)
    dashboard = (REPO / "docs" / "grafana.json").read_text()
    exported = {name.removesuffix(suffix) for name, _ in after for suffix in ("_bucket", "")}
    assert set(re.findall(r"minisarathi:\w+", dashboard)) - exported == {p + "gpu_memory_used_bytes"}


def test_metrics_port_with_only_the_msgpack_door():
    with launch("--metrics-port", "0", "--num-kv-blocks", "64") as s:
        with Client("127.0.0.1", s.msgpack_port, api_key=API_KEY) as client:
            result = client.generate("Once upon a time", max_tokens=6, temperature=0, ignore_eos=True)
        metrics = scrape(s.metrics_port)
        assert metrics[("minisarathi:generation_tokens_total", ())] == 6 == result.completion_tokens
        assert metrics[("minisarathi:prompt_tokens_total", ())] == result.prompt_tokens
        assert metrics[("minisarathi:request_success_total", (("finished_reason", "length"),))] == 1
        assert metrics[("minisarathi:e2e_request_latency_seconds_count", ())] == 1
        status, _, _ = raw(s, "POST", "/v1/completions", {"prompt": "x"}, port=s.metrics_port)
        assert status == 404  # the metrics port serves no API


def test_http_port_without_the_extra_names_the_install_command(tmp_path):
    (tmp_path / "aiohttp").mkdir()
    (tmp_path / "aiohttp" / "__init__.py").write_text(
        "raise ImportError('hidden for the test', name='aiohttp')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "minisarathi", "serve", "--http-port", "0"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"},
    )
    assert proc.returncode == 2
    assert "pip install 'minisarathi[http]'" in proc.stderr and "aiohttp" in proc.stderr


# ------------------------------------------------------------------------------------------------ ids and
# logs


def test_request_ids_follow_requests_through_both_doors_and_json_logs():
    with launch(
        "--http-port", "0", "--num-kv-blocks", "128", "--log-format", "json", "--log-level", "DEBUG"
    ) as s:
        with Client("127.0.0.1", s.msgpack_port, api_key=API_KEY) as client:
            result = client.generate("Once upon a time", max_tokens=4, temperature=0, request_id="rpc-7")
            assert result.extra["request_id"] == "rpc-7"
            generated = client.generate("Zoo", max_tokens=2)
            assert generated.extra["request_id"].startswith("req-")
            with pytest.raises(Exception, match="request_id must be 1 to 128 printable"):
                client.generate("Zoo", max_tokens=2, request_id="has space")
            stream = client.generate_stream(
                "Once upon a time", max_tokens=400, ignore_eos=True, request_id="long-1"
            )
            next(iter(stream))
            assert client.call("abort", {"request_id": "long-1"}) is True
        status, headers, body = raw(
            s,
            "POST",
            "/v1/completions",
            {"prompt": "Tom", "max_tokens": 3},
            headers={"X-Request-Id": "web-9"},
        )
        assert status == 200 and body["id"] == headers["X-Request-Id"] == "web-9"
        status, _, error = raw(
            s, "POST", "/v1/completions", {"prompt": "Tom"}, headers={"X-Request-Id": "a b"}
        )
        assert status == 400 and error["error"]["param"] == "X-Request-Id"
        status, headers, error = raw(
            s, "POST", "/v1/completions", {"prompt": "Tom", "n": 0}, headers={"X-Request-Id": "bad-n-1"}
        )
        assert status == 400 and headers["X-Request-Id"] == "bad-n-1"  # errors carry the id too
        time.sleep(0.5)
        lines = [json.loads(line) for line in Path(s.log_path).read_text().splitlines()]  # every line is JSON
    finished = {line["request_id"]: line for line in lines if line["logger"] == "minisarathi.requests"}
    assert finished["rpc-7"]["door"] == "msgpack" and finished["rpc-7"]["completion_tokens"] == 4
    assert (
        finished["rpc-7"]["prompt"] == "Once upon a time" and finished["rpc-7"]["finish_reason"] == "length"
    )
    assert finished["rpc-7"]["client"].startswith("127.0.0.1:")
    assert finished["rpc-7"]["ttft_s"] <= finished["rpc-7"]["e2e_s"] and finished["rpc-7"]["queue_s"] >= 0
    assert finished["long-1"]["finish_reason"] == "abort"
    assert finished["web-9"]["door"] == "http" and finished["web-9"]["completion_tokens"] == 3
    assert [line for line in lines if "web-9" in line["message"]]  # the door's own line names it too
    steps = [line for line in lines if line["message"] == "step"]
    assert steps and all(
        {"decodes", "prefill_tokens", "preempted", "kv_blocks_free"} <= set(line) for line in steps
    )


def test_n_above_one_on_the_msgpack_door(server):
    with Client("127.0.0.1", server.msgpack_port, api_key=API_KEY) as client:
        result = client.generate("Once upon a time", n=3, max_tokens=10, temperature=1.0, seed=5)
        choices = result.extra["choices"]
        alone = [
            client.generate("Once upon a time", max_tokens=10, temperature=1.0, seed=5 + i) for i in range(3)
        ]
        assert [c["token_ids"] for c in choices] == [a.token_ids for a in alone]
        assert [c["index"] for c in choices] == [0, 1, 2] and result.token_ids == choices[0]["token_ids"]
        assert result.completion_tokens == sum(len(c["token_ids"]) for c in choices)
        stream = client.generate_stream("Once upon a time", n=2, max_tokens=10, temperature=1.0, seed=5)
        chunks = list(stream)
        for i in range(2):
            assert "".join(c.text for c in chunks if c.index == i) == alone[i].text
        with pytest.raises(Exception, match="n must be <= 4"):
            client.generate("Zoo", n=MAX_N + 1)
    wait_until_idle(server)


def test_an_unexpected_exception_is_an_openai_shaped_500_with_the_request_id(caplog):
    from aiohttp.test_utils import make_mocked_request

    from minisarathi.server.http import HttpDoor

    async def broken(request):
        request["request_id"] = "bug-1"
        raise ZeroDivisionError("division by zero")

    async def auth_turn(address):
        return True

    hub = SimpleNamespace(auth_turn=auth_turn, authenticate=lambda secret, address: (True, None))
    door = SimpleNamespace(hub=hub, connections={}, _authenticate=lambda *a: HttpDoor._authenticate(door, *a))
    response = asyncio.run(HttpDoor._middleware(door, make_mocked_request("POST", "/v1/completions"), broken))
    error = json.loads(response.body)["error"]
    assert response.status == 500 and response.headers["X-Request-Id"] == "bug-1"
    assert (
        error["code"] == "internal_error" and "bug-1" in error["message"] and error["type"] == "server_error"
    )
    assert "ZeroDivisionError" in caplog.text and "bug-1" in caplog.text
