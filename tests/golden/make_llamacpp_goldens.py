"""Greedy tokens and their top-2 log-probabilities from llama.cpp's llama-server, for the bundled GGUF files
and make_kquant_gguf.py's per-type files: the goldens of tests/unit/test_llamacpp_goldens.py.

    python tests/golden/make_llamacpp_goldens.py LLAMA_SERVER [OUT.json]

For each file (recorded with its sha256: the kquant files are written again, byte for byte, by the test) and
each prompt (token ids, BOS first), llama-server runs one slot with a float32 KV cache and samples greedily;
n_probs=2 gives, at every generated token, the two largest log-probabilities of the raw logits (before any
sampler), so their difference is the top-2 logit gap. ignore_eos masks EOS out of the sampling, not
out of the log-probabilities.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = Path(__file__).with_name("llamacpp_greedy.json")
BUNDLED = ["stories260K-q8_0.gguf", "stories260K-f32.gguf"]
KQUANT = ["kquant-q8_0.gguf", "kquant-q4_0.gguf", "kquant-q4_k.gguf", "kquant-q5_k.gguf", "kquant-q6_k.gguf"]
KQUANT += ["kquant-q4_k_m.gguf"]
PROMPTS = [[1, 403, 407, 261, 378, 400], [1, *range(3, 400, 23)], [1, 71, 94, 200, 13, 7, 300, 41]]
NEW_TOKENS = 24

_spec = importlib.util.spec_from_file_location("make_kquant", Path(__file__).with_name("make_kquant_gguf.py"))
make_kquant = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_kquant)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(port: int, path: str, body: dict) -> dict:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def greedy(binary: str, gguf: Path) -> list[dict]:
    port = free_port()
    command = [binary, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-np", "1", "-c", "512"]
    command += ["-t", "1", "-ctk", "f32", "-ctv", "f32", "--no-cache-prompt", "--no-warmup"]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(300):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.1)
        else:
            raise RuntimeError(f"llama-server did not start on {gguf}")
        cases = []
        for prompt in PROMPTS:
            # one token a request: the server leaves out the probabilities of a token that ends inside a
            # UTF-8 character (a byte token), so a longer generation's list does not line up with its
            # tokens; such a token is recorded with top2 None
            tokens, top2 = [], []
            for _ in range(NEW_TOKENS):
                body = {"prompt": prompt + tokens, "n_predict": 1, "temperature": 0, "n_probs": 2}
                body |= {"cache_prompt": False, "ignore_eos": True, "return_tokens": True}
                result = post(port, "/completion", body)
                (token,) = result["tokens"]
                steps = result.get("completion_probabilities") or [None]
                assert steps[0] is None or steps[0]["id"] == token, result
                tokens.append(token)
                top2.append(steps[0] and [[t["id"], t["logprob"]] for t in steps[0]["top_logprobs"][:2]])
            cases.append({"prompt": prompt, "tokens": tokens, "top2": top2})
        return cases
    finally:
        server.terminate()
        server.wait(30)


def version(binary: str) -> str:
    run = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60)
    return next((line for line in (run.stdout + run.stderr).splitlines() if line.startswith("version")), "")


def main(binary: str, out: Path = OUT) -> None:
    goldens = {"llama_cpp": version(binary), "new_tokens": NEW_TOKENS, "files": {}}
    with tempfile.TemporaryDirectory() as tmp:
        paths = [ROOT / "models/stories260K-gguf" / name for name in BUNDLED]
        paths += [make_kquant.write(Path(tmp), name) for name in KQUANT]
        for path in paths:
            sha = hashlib.sha256(path.read_bytes()).hexdigest()
            goldens["files"][path.name] = {"sha256": sha, "cases": greedy(binary, path)}
            print(path.name, "done", file=sys.stderr)
    out.write_text(json.dumps(goldens, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]) if len(sys.argv) > 2 else OUT)
