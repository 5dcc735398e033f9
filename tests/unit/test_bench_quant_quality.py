"""bench/quant_quality.py on the bundled model: its perplexity against one computed independently (a float64
forward), its rows for a format that quantizes by rows (Q8_0) and one that cannot (Q4_K, 256-wide blocks
over rows of 64), and its errors."""

import json

import numpy as np
import pytest

pytest.importorskip("gguf")

from bench.quant_quality import main, story  # noqa: E402
from minisarathi.config import ModelConfig  # noqa: E402
from minisarathi.model.loader import load_weights  # noqa: E402
from minisarathi.paths import default_model_dir  # noqa: E402
from minisarathi.testing import float64_logits  # noqa: E402
from minisarathi.tokenizer import Tokenizer  # noqa: E402


def test_rows_and_the_perplexity(capsys):
    rows = main(["--formats", "Q8_0,Q4_K"])
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert printed == rows and [r["format"] for r in rows] == ["F32", "Q8_0", "Q4_K"]
    model = default_model_dir()
    ids = Tokenizer.from_pretrained(model).encode(story())
    config = ModelConfig.from_pretrained(model)
    logits = float64_logits(config, load_weights(model, config), ids)
    logits -= logits.max(-1, keepdims=True)
    nll = np.log(np.exp(logits).sum(-1))[:-1] - logits[np.arange(len(ids) - 1), ids[1:]]
    f32, q8, q4k = rows
    assert f32["positions"] == len(ids) and f32["top1_agreement"] == 1.0 and f32["mean_kl"] == 0.0
    assert f32["perplexity"] == pytest.approx(np.exp(nll.mean()), rel=1e-4)
    # 16 of 21 matrices have rows of 64, whole Q8_0 blocks; down_proj's 172 are not
    assert (q8["matrices_by_rows"], q8["matrices_flat"], q8["bits_per_weight"]) == (16, 5, 8.5)
    assert q8["top1_agreement"] >= 0.97 and 0 < q8["mean_kl"] < q4k["mean_kl"]
    assert q4k["matrices_by_rows"] == 0 and q4k["matrices_flat"] == 21 and q4k["bits_per_weight"] == 4.5
    assert q4k["perplexity"] > q8["perplexity"] > f32["perplexity"]


def test_an_unknown_format_is_named(capsys):
    with pytest.raises(SystemExit):
        main(["--formats", "Q8_0,Q2_K"])
    assert "unknown formats Q2_K" in capsys.readouterr().err
