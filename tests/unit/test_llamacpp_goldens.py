"""Our logits against llama.cpp's on the same GGUF files (goldens: tests/golden/make_llamacpp_goldens.py,
which records llama-server's greedy tokens and, at each, its two largest log-probabilities).

Teacher-forced on llama.cpp's tokens: at every position our log-probabilities of its top-2 tokens are
within TOLERANCE of its own (relative to the row's largest |logit|), and where its top-2 gap exceeds twice
that our greedy token is its token.
llama.cpp rounds activations to 8 bits for its quantized dot products (Q8_0 blocks, Q8_K for the K-quants)
and ours round them per block of 32 too but not alike, so the two differ by more than float32 rounding;
the tolerances are about 1.5-4x the largest difference measured."""

import hashlib
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("gguf")

from minisarathi.model.families import load_model  # noqa: E402
from minisarathi.testing import prefill_then_greedy  # noqa: E402

ROOT = Path(__file__).parents[2]
GOLDENS = json.loads((ROOT / "tests/golden/llamacpp_greedy.json").read_text())
_spec = importlib.util.spec_from_file_location("make_kquant", ROOT / "tests/golden/make_kquant_gguf.py")
make_kquant = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_kquant)
# |our log-probability - llama.cpp's| / the row's largest |logit|: measured at most 5e-4 on the float32
# file and 0.019 on the quantized ones (llama.cpp's 8-bit activation blocks differ from ours)
TOLERANCE = {"f32": 2e-3, "quantized": 0.03}
# a top-2 gap that the two sides' errors cannot close: each side's top-2 log-probabilities are within the
# tolerance of the other's
GAP_BOUND = 2


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


def compare(path: Path, cases: list[dict]) -> tuple[float, int, int, int]:
    """(the largest log-probability difference relative to its row's largest |logit|, positions compared,
    of them those whose top-2 gap exceeds GAP_BOUND x the tolerance, of those the ones whose greedy tokens
    differ), teacher-forced on llama.cpp's tokens."""
    model = load_model(path)
    tolerance = TOLERANCE["f32" if path.name.endswith("f32.gguf") else "quantized"]
    worst, compared, decisive, differ = 0.0, 0, 0, 0
    for case in cases:
        prompt, tokens = case["prompt"], case["tokens"]
        logits, _ = prefill_then_greedy(model, prompt + tokens[:-1], 1)
        logits = logits[len(prompt) - 1 :].astype(np.float64)  # the rows that predict `tokens`
        shifted = logits - logits.max(1, keepdims=True)
        logprobs = shifted - np.log(np.exp(shifted).sum(1, keepdims=True))
        for row, scale, token, top2 in zip(
            logprobs, np.abs(logits).max(1), tokens, case["top2"], strict=True
        ):
            if top2 is None:
                continue  # a byte token, whose probabilities llama-server does not report
            compared += 1
            # llama.cpp's float32 softmax underflows to -FLT_MAX past a gap of ~100: nothing to compare
            worst = max(worst, *(abs(row[i] - lp) / scale for i, lp in top2 if lp > -1e30))
            if top2[0][1] - top2[1][1] > GAP_BOUND * tolerance * scale:
                decisive += 1
                differ += int(row.argmax()) != token
    return worst, compared, decisive, differ


@pytest.mark.parametrize("name", list(GOLDENS["files"]))
def test_greedy_tokens_and_log_probabilities_equal_llama_cpps(paths, name):
    worst, compared, decisive, differ = compare(paths[name], GOLDENS["files"][name]["cases"])
    assert worst <= TOLERANCE["f32" if name.endswith("f32.gguf") else "quantized"], name
    assert differ == 0 and compared >= 48 and decisive >= compared // 3, (compared, decisive, differ)


def test_another_formats_goldens_are_told_apart(paths):
    # Q4_0's log-probabilities against the Q8_0 file's: the quantization error the comparison must see
    worst, *_ = compare(paths["kquant-q8_0.gguf"], GOLDENS["files"]["kquant-q4_0.gguf"]["cases"])
    assert worst > TOLERANCE["quantized"]
