"""What a model says about its weights: the matrices' storage (weight_format) and the bytes the placed
weights take (weight_bytes), which the engine logs at start-up beside the KV pool and reports in stats
(and the doors in model_info and /v1/models)."""

import importlib.util
import logging
from pathlib import Path

import numpy as np
import pytest

from minisarathi.engine.engine import LLMEngine
from minisarathi.model.families import load_model
from minisarathi.model.loader import read_checkpoint
from minisarathi.paths import default_model_dir
from minisarathi.quant.layouts import weight_format

ROOT = Path(__file__).parents[2]
Q8_GGUF = ROOT / "models/stories260K-gguf/stories260K-q8_0.gguf"


def test_reference_weights_take_four_bytes_per_parameter_with_a_tied_table_counted_once():
    model = load_model(default_model_dir(), device="reference")
    parameters = sum(int(np.prod(t.shape)) for t in read_checkpoint(default_model_dir()).values())
    assert model.config.tie_word_embeddings  # lm_head is the embedding table: no second copy
    assert model.weight_bytes == 4 * parameters
    assert model.weight_format == "float32"


def test_a_q8_0_file_takes_about_a_quarter_of_float32_on_the_cpu():
    model = load_model(Q8_GGUF)
    fp32 = load_model(default_model_dir(), device="reference")
    assert model.weight_format == "Q8_0+float16"  # its matrices, then its 16-bit embedding table
    assert model.weight_bytes < 0.5 * fp32.weight_bytes


def test_a_fused_matrix_of_mixed_types_counts_each_part_under_its_own(tmp_path):
    pytest.importorskip("gguf")
    spec = importlib.util.spec_from_file_location("make_kquant", ROOT / "tests/golden/make_kquant_gguf.py")
    make = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make)
    weights = read_checkpoint(make.write(tmp_path, "kquant-q4_k_m.gguf"))
    assert weight_format(weights) == "Q4_K+Q6_K"
    assert weight_format({"w": np.zeros((2, 2), np.float16), "norm": np.zeros(2, np.float32)}) == "float16"


def test_the_engine_logs_the_weights_and_the_kv_pool_and_reports_them(caplog):
    with caplog.at_level(logging.INFO, logger="minisarathi.engine"):
        engine = LLMEngine(Q8_GGUF, num_kv_blocks=64, block_size=16)
    stats = engine.stats()
    assert stats["weight_format"] == "Q8_0+float16" and stats["weight_bytes"] == engine.model.weight_bytes
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("weights:"))
    mib = 64 * engine.model.kv_cache_bytes_per_block(16) / 2**20
    assert line == (
        f"weights: Q8_0+float16, {engine.model.weight_bytes / 2**20:.1f} MiB on cpu; "
        f"KV pool: 64 blocks of 16 tokens, {mib:.1f} MiB"
    )
