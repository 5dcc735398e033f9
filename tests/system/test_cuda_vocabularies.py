"""Vocabularies whose sampler launches need more than 48 KiB of shared memory once the kernel's static shared
memory counts: greedy tokens on the CUDA emulator equal the CPU's, with graphs on and off. The
top_k=1 request goes through sample_kernel (a sampled row), the greedy one through the argmax path."""

import platform

import pytest

from minisarathi.bench.random_model import write_random_model
from minisarathi.llm import LLM
from minisarathi.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(
    platform.machine() != "x86_64", reason="the CUDA emulator is x86-64 Linux only"
)

PROMPTS = [[1, 5, 9, 300, 17], [1, 7]]
PARAMS = [
    SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
    SamplingParams(max_tokens=6, temperature=0.8, top_k=1, seed=3, ignore_eos=True),
]


def tokens(path, device: str, **options) -> list[list[int]]:
    llm = LLM(model=str(path), device=device, max_num_seqs=2, max_model_len=32, block_size=8, **options)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]


@pytest.mark.parametrize("vocab_size", [10007, 65024, 92544])
def test_emulated_greedy_tokens_equal_the_cpus(tmp_path, vocab_size):
    path = write_random_model(
        tmp_path / "model",
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        vocab_size=vocab_size,
    )
    expected = tokens(path, "cpu")
    assert tokens(path, "cuda-emulated", cuda_graphs=False) == expected
    assert tokens(path, "cuda-emulated", cuda_graphs=True) == expected
