"""Embeddings through both doors of one server process (the random Qwen3 model tests/golden/qwen3_yarn_tied,
goldens from transformers by make_embedding_goldens.py): /v1/embeddings through the official `openai` SDK
(base64) and raw HTTP (float), the msgpack door's `embed`, beside a greedy generation whose tokens stay the
golden's; the key's quota counts one request per input; bad input is a clear 400 / invalid_params, and the
server ends with every KV block free and no traceback in its log."""

import base64
import importlib.util
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
from test_server import launch_server
from test_server_keys import http_port, post

from minisarathi.client import Client, RPCError
from minisarathi.paths import default_model_dir
from minisarathi.server.auth import add_key

pytestmark = pytest.mark.skipif(not importlib.util.find_spec("aiohttp"), reason="the http extra is needed")
GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "qwen3_yarn_tied"
EMBEDDINGS = np.load(GOLDEN / "embeddings.npz")
PROMPTS = [EMBEDDINGS[f"prompt_{i}"].tolist() for i in range(4)]
EXPECTED = [EMBEDDINGS[f"embedding_{i}"] for i in range(4)]
MIN_COSINE = 0.9999
MODEL = "qwen3_yarn_tied"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("embed")
    folder = shutil.copytree(GOLDEN, tmp / MODEL)
    shutil.copy(default_model_dir() / "tokenizer.json", folder)  # its ids are never encoded here
    keys = tmp / "keys.toml"
    secrets = {"main": add_key(keys, "main"), "three": add_key(keys, "three", rpm=3)}
    args = ["--keys-file", str(keys), "--http-port", "0", "--chunk-size", "5", "--block-size", "4"]
    with launch_server(str(folder), *args, "--max-model-len", "64", "--num-kv-blocks", "64") as s:
        s.secrets, s.http_port = secrets, http_port(s)
        yield s
        log = Path(s.log_path).read_text()
    assert "Traceback" not in log, log


def cosine(got, want) -> float:
    got = np.asarray(got, np.float64)
    return float(got @ want / np.linalg.norm(got) / np.linalg.norm(want))


def test_http_and_msgpack_embeddings_match_transformers_beside_a_generation(server):
    golden = np.load(GOLDEN / "golden.npz")
    key = server.secrets["main"]
    generated = {}

    def generate():  # a greedy generation in flight while the embeddings run
        with Client("127.0.0.1", server.port, api_key=key, timeout=60) as c:
            prompt = golden["prompt"].tolist()
            generated["tokens"] = c.generate(prompt, max_tokens=16, temperature=0, ignore_eos=True).token_ids

    thread = threading.Thread(target=generate)
    thread.start()
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key=key, max_retries=0)
    result = client.embeddings.create(input=PROMPTS, model=MODEL)  # the SDK asks for base64, decodes it
    assert [d.index for d in result.data] == [0, 1, 2, 3]
    assert min(cosine(d.embedding, e) for d, e in zip(result.data, EXPECTED)) >= MIN_COSINE
    assert result.usage.prompt_tokens == result.usage.total_tokens == sum(map(len, PROMPTS))
    status, headers, body = post(
        server.http_port, "/v1/embeddings", {"input": PROMPTS[2], "encoding_format": "float"}, key
    )
    assert status == 200 and body["object"] == "list" and body["model"] == MODEL
    assert headers["X-Request-Id"].startswith("embd-")
    assert cosine(body["data"][0]["embedding"], EXPECTED[2]) >= MIN_COSINE
    status, _, body = post(
        server.http_port,
        "/v1/embeddings",
        {"input": [PROMPTS[3]], "encoding_format": "base64", "dimensions": 8},
        key,
    )
    truncated = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), "<f4")
    assert status == 200 and truncated.shape == (8,) and cosine(truncated, EXPECTED[3][:8]) >= MIN_COSINE
    with Client("127.0.0.1", server.port, api_key=key, timeout=60) as c:
        for prompt, expected in zip(PROMPTS, EXPECTED):
            result = c.call("embed", {"prompt_token_ids": prompt})
            assert cosine(result["embedding"], expected) >= MIN_COSINE
            assert result["prompt_tokens"] == len(prompt)
        named = c.call("embed", {"prompt_token_ids": PROMPTS[1], "dimensions": 16, "request_id": "mine"})
        assert named["request_id"] == "mine" and len(named["embedding"]) == 16
        thread.join()
        assert generated["tokens"] == golden["greedy_tokens"].tolist()
        stats = c.stats()
        assert stats["kv_blocks_used"] == 0 and stats["running"] == 0, stats


def test_the_quota_counts_each_input_as_a_request(server):
    three = server.secrets["three"]
    status, _, error = post(server.http_port, "/v1/embeddings", {"input": PROMPTS}, three)
    assert status == 400 and "counts as 4 requests" in error["error"]["message"], error
    status, _, _ = post(server.http_port, "/v1/embeddings", {"input": PROMPTS[1:3]}, three)
    assert status == 200
    with Client("127.0.0.1", server.port, api_key=three, timeout=60) as c:
        used = c.stats()["keys"]["three"]
        assert used["requests"] == 2 and used["prompt_tokens"] == len(PROMPTS[1]) + len(PROMPTS[2]), used
        c.call("embed", {"prompt_token_ids": PROMPTS[0]})  # the third of the minute
        with pytest.raises(RPCError, match="rate_limited"):
            c.call("embed", {"prompt_token_ids": PROMPTS[0]})


@pytest.mark.parametrize(
    "body, param, message",
    [
        ({"input": []}, "input", "input must be a string"),
        ({"input": [[]]}, "input", "input is empty"),
        ({"input": "a"}, "input", "outside the vocabulary"),  # the bundled tokenizer's ids pass 128
        ({"input": [5] * 65}, "input", "the limit is 64"),
        ({"input": [5], "dimensions": 0}, "dimensions", "dimensions must be an integer in [1, 64]"),
        ({"input": [5], "dimensions": 65}, "dimensions", "hidden_size"),
        ({"input": [5], "encoding_format": "int8"}, "encoding_format", "'float' or 'base64'"),
        ({"input": [5], "pooling": "mean"}, "pooling", "unknown field"),
    ],
)
def test_bad_http_input_is_a_clear_400(server, body, param, message):
    status, _, error = post(server.http_port, "/v1/embeddings", body, server.secrets["main"])
    assert status == 400 and error["error"]["param"] == param and message in error["error"]["message"], error


def test_bad_msgpack_input_is_invalid_params(server):
    with Client("127.0.0.1", server.port, api_key=server.secrets["main"], timeout=60) as c:
        for params, message in [
            ({"prompt_token_ids": [5], "pooling": "mean"}, "unknown field"),
            ({}, "exactly one of prompt, prompt_token_ids"),
            ({"prompt_token_ids": [600]}, "prompt_token_ids must be integers in"),
            ({"prompt_token_ids": [5] * 65}, "the limit is 64"),
            ({"prompt_token_ids": [5], "dimensions": 65}, "hidden_size"),
            ({"prompt": "a"}, "outside the vocabulary"),
        ]:
            with pytest.raises(RPCError, match=message):
                c.call("embed", params)
        assert c.call("embed", {"prompt_token_ids": [5]})["prompt_tokens"] == 1  # still serving
