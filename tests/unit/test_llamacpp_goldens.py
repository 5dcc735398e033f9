"""Our logits against llama.cpp's on the same GGUF files (goldens: tests/golden/make_llamacpp_goldens.py,
which records llama-server's greedy tokens and, at each, its two largest log-probabilities).

Teacher-forced on llama.cpp's tokens: at every position our log-probabilities of its top-2 tokens are
within LOGPROB_TOL of its own, and where its top-2 gap exceeds GAP_BOUND our greedy token is its token.
llama.cpp rounds activations to 8 bits for its quantized dot products (Q8_0 blocks, Q8_K for the K-quants)
and we do not, so the two differ by more than float32 rounding; the bounds are a few times the largest
difference measured (see the goldens' script)."""

import hashlib
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("gguf")

from minisarathi.model.llama import load_model  # noqa: E402
from minisarathi.testing import prefill_then_greedy  # noqa: E402

ROOT = Path(__file__).parents[2]
GOLDENS = json.loads((ROOT / "tests/golden/llamacpp_greedy.json").read_text())
_spec = importlib.util.spec_from_file_location("make_kquant", ROOT / "tests/golden/make_kquant_gguf.py")
make_kquant = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_kquant)
LOGPROB_TOL = 0.05
GAP_BOUND = 2 * LOGPROB_TOL  # each side's top-2 log-probabilities are within LOGPROB_TOL of the other's


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("kquant")
    found = {}
    for name, golden in GOLDENS["files"].items():
        path = ROOT / "models/stories260K-gguf" / name
        path = path if path.exists() else make_kquant.write(out, name)
        assert hashlib.sha256(path.read_bytes()).hexdigest() == golden["sha256"], name
        found[name] = path
    return found


def compare(path: Path, cases: list[dict]) -> tuple[float, int, int]:
    """(the largest log-probability difference, positions whose gap exceeds GAP_BOUND, of them those whose
    greedy tokens differ) over every case, teacher-forced on llama.cpp's tokens."""
    model = load_model(path)
    worst, decisive, differ = 0.0, 0, 0
    for case in cases:
        prompt, tokens = case["prompt"], case["tokens"]
        logits, _ = prefill_then_greedy(model, prompt + tokens[:-1], 1)
        logits = logits[len(prompt) - 1 :].astype(np.float64)  # the rows that predict `tokens`
        logprobs = logits - np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1, keepdims=True))
        logprobs -= logits.max(1, keepdims=True)
        for row, token, top2 in zip(logprobs, tokens, case["top2"], strict=True):
            worst = max(worst, *(abs(row[i] - lp) for i, lp in top2))
            if top2[0][1] - top2[1][1] > GAP_BOUND:
                decisive += 1
                differ += int(row.argmax()) != token
    return worst, decisive, differ


@pytest.mark.parametrize("name", list(GOLDENS["files"]))
def test_greedy_tokens_and_log_probabilities_equal_llama_cpps(paths, name):
    worst, decisive, differ = compare(paths[name], GOLDENS["files"][name]["cases"])
    assert worst <= LOGPROB_TOL, name
    assert differ == 0 and decisive >= len(GOLDENS["files"][name]["cases"]) * GOLDENS["new_tokens"] // 2


def test_another_formats_goldens_are_told_apart(paths):
    # Q4_0's logits against the Q8_0 file's: the quantization error the comparison must see
    worst, _, _ = compare(paths["kquant-q8_0.gguf"], GOLDENS["files"]["kquant-q4_0.gguf"]["cases"])
    assert worst > 2 * LOGPROB_TOL
