"""Structured outputs on the CUDA backend, through the CPU emulator: cuda/token_bitmask.cu against the host's
bitmask (minisarathi/structured.py), a negative control (the kernel with its bit index wrong must fail the
same comparison), and the engine on device="cuda-emulated" generating what it generates on the CPU."""

from __future__ import annotations

import json
import platform

import numpy as np
import pytest

pytest.importorskip("llguidance", reason="structured outputs need the structured extra (llguidance)")

from minisarathi import structured  # noqa: E402
from minisarathi.backends import cuda_ops, emulator  # noqa: E402
from minisarathi.llm import LLM  # noqa: E402
from minisarathi.paths import cuda_dir  # noqa: E402
from minisarathi.sampling_params import SamplingParams  # noqa: E402

pytestmark = [
    pytest.mark.system,
    pytest.mark.skipif(platform.machine() != "x86_64", reason="the CUDA emulator is x86-64 Linux only"),
]


def case(vocab: int, seed: int):
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((6, vocab)).astype(np.float32)
    rows = np.array([5, 1, 2, 0])
    bitmask = rng.integers(0, 2**32, (4, structured.bitmask_words(vocab)), dtype=np.uint64).astype(np.uint32)
    bitmask[2] = 0xFFFFFFFF  # a row that allows everything
    return logits, rows, bitmask.view(np.int32)


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 512, 1000])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_bitmask_kernel_matches_the_host(vocab, dtype):
    sampler = cuda_ops.emulated(dtype).new_sampler(vocab)
    logits, rows, bitmask = case(vocab, vocab)
    device_logits = cuda_ops.emulated(dtype).launcher.to_device(logits)
    if dtype == "bfloat16":  # the forward's activation dtype: the sampler converts it to float32 first
        from minisarathi.dtypes import convert

        device_logits = convert(logits, "float32", "bfloat16")
        logits = convert(device_logits, "bfloat16", "float32")
    masked = sampler.apply_token_bitmask(device_logits, rows, bitmask)
    np.testing.assert_array_equal(masked, structured.apply_token_bitmask(logits, rows, bitmask))
    assert masked.dtype == np.float32 and masked is not device_logits
    np.testing.assert_array_equal(masked[[3, 4]], logits[[3, 4]])  # unconstrained rows are untouched


def test_negative_control_a_wrong_bit_index_is_caught(tmp_path):
    """The kernel with each word's bits read 16 apart (t & 15): the comparison above must fail."""
    source = (cuda_dir() / "token_bitmask.cu").read_text()
    assert "(t & 31)" in source
    broken = tmp_path / "token_bitmask_broken.cu"
    broken.write_text(source.replace("(t & 31)", "(t & 15)"))
    kernel = emulator.load_module(broken, ["apply_token_bitmask_kernel"], (cuda_dir(),)).get_function(
        "apply_token_bitmask_kernel"
    )
    logits, rows, bitmask = case(512, 7)
    x = logits.copy()
    kernel(
        (len(rows),),
        (128,),
        (x, np.int32(512), rows.astype(np.int64), bitmask.view(np.uint32), np.int32(bitmask.shape[1])),
    )
    assert (x != structured.apply_token_bitmask(logits, rows, bitmask)).sum() > 100


def test_the_engine_on_emulated_kernels_generates_what_it_generates_on_the_cpu():
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"}},
        "required": ["name", "ok"],
        "additionalProperties": False,
    }
    prompts = ["Once upon a time", "Tom had a red"]
    params = [
        SamplingParams(temperature=0, max_tokens=40, structured={"json": schema}),
        SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=40, structured={"regex": "[a-z]{2,5}!"}),
    ]

    def generate(device):
        llm = LLM(chunk_size=8, block_size=4, num_kv_blocks=64, device=device)
        return [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params)], llm

    expected, _ = generate("cpu")
    tokens, llm = generate("cuda-emulated")
    assert isinstance(llm.engine.model.ops, cuda_ops.CudaOps)
    assert tokens == expected
    json.loads(llm.engine.tokenizer.decode(tokens[0][0]))
