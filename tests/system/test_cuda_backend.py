"""Whole models through the CUDA backend's kernels: on the CPU emulator always, on a real GPU when present."""

from __future__ import annotations

import platform
from pathlib import Path

import numpy as np
import pytest

from minisarathi import dtypes
from minisarathi.backends import cuda_ops
from minisarathi.backends.cpu.ops import CpuOps
from minisarathi.backends.reference import ReferenceOps
from minisarathi.config import ModelConfig
from minisarathi.dtypes import bf16_to_float32
from minisarathi.model.families import FAMILIES, load_model
from minisarathi.model.llama import LlamaModel
from minisarathi.model.loader import load_weights, read_checkpoint
from minisarathi.paths import default_model_dir
from minisarathi.testing import ScheduledChunk, build_batch

GOLDEN = Path(__file__).parents[1] / "golden"
# every folder make_goldens.py made (tests/golden/<name>/golden.npz)
GOLDEN_MODELS = sorted(path.parent.name for path in GOLDEN.glob("*/golden.npz"))


def build_model(path: Path, ops) -> LlamaModel:
    config = ModelConfig.from_pretrained(path)
    return FAMILIES.get(config.architecture, LlamaModel)(config, load_weights(path, config), ops)


def run_mixed_steps(model, prompts: list[list[int]], new_tokens: int, chunk_size: int, block_size: int = 4):
    """Greedy generation for several sequences with chunked prefills and decodes sharing batches, as the
    Sarathi scheduler would mix them. Returns (token lists, every step's logits)."""
    tables, next_block = [], 0
    for p in prompts:
        need = -(-(len(p) + new_tokens) // block_size)
        tables.append(list(range(next_block + need - 1, next_block - 1, -1)))  # blocks in reverse order
        next_block += need
    cache = model.new_kv_cache(next_block, block_size)
    tokens = [list(p) for p in prompts]
    done = [0] * len(prompts)  # tokens of each sequence already in the cache
    target = [len(p) + new_tokens for p in prompts]
    all_logits = []
    while any(len(t) < n for t, n in zip(tokens, target)):
        chunks, owners = [], []
        budget = chunk_size
        for s, t in enumerate(tokens):
            if len(t) >= target[s] or budget == 0:
                continue
            take = min(budget, len(t) - done[s])
            chunks.append(
                ScheduledChunk(t[done[s] : done[s] + take], done[s], tables[s], done[s] + take == len(t))
            )
            owners.append(s)
            done[s] += take
            budget -= take
        logits = model.forward(build_batch(chunks, block_size), cache)
        all_logits.append(logits)
        sampled = [s for s, c in zip(owners, chunks) if c.sample]
        for s, row in zip(sampled, logits):
            tokens[s].append(int(row.argmax()))
    return tokens, np.concatenate(all_logits)


emulator_only = pytest.mark.skipif(
    platform.machine() != "x86_64", reason="the CUDA emulator is x86-64 Linux only"
)
PROMPTS = [
    [1, 403, 407, 261, 378, 10, 65, 2],
    [1, 9],
    [1, 300, 301, 302, 303, 304, 305, 306, 307, 308, 309, 310],
]


def _gpu_available() -> str | None:
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() > 0:
            return None
        return "no CUDA device"
    except Exception as exc:  # no CuPy, or no driver
        return f"no usable GPU ({type(exc).__name__})"


ON_GPU = pytest.mark.skipif(_gpu_available() is not None, reason=str(_gpu_available()))


@emulator_only
def test_bundled_model_on_emulated_kernels_matches_the_reference():
    reference, ref_logits = run_mixed_steps(
        build_model(default_model_dir(), ReferenceOps()), PROMPTS, 12, chunk_size=7
    )
    tokens, logits = run_mixed_steps(
        build_model(default_model_dir(), cuda_ops.emulated()), PROMPTS, 12, chunk_size=7
    )
    assert tokens == reference
    np.testing.assert_allclose(logits, ref_logits, atol=2e-4 * np.abs(ref_logits).max())


@emulator_only
def test_bundled_model_in_bfloat16_stays_close():
    _, ref_logits = run_mixed_steps(
        build_model(default_model_dir(), ReferenceOps()), PROMPTS[:2], 3, chunk_size=16
    )
    _, logits = run_mixed_steps(
        build_model(default_model_dir(), cuda_ops.emulated("bfloat16")), PROMPTS[:2], 3, chunk_size=16
    )
    # bf16 keeps 8 bits of mantissa through 5 layers: logits agree to about 1.5% of their range (measured).
    assert np.abs(logits - ref_logits).max() <= 0.03 * np.abs(ref_logits).max()


@emulator_only
@pytest.mark.parametrize("name", GOLDEN_MODELS)
def test_golden_models_on_emulated_kernels(name):
    """GQA, MHA, QKV bias, tied embeddings, linear and llama3 RoPE scaling against transformers' logits."""
    golden = np.load(GOLDEN / name / "golden.npz")
    prompt = golden["prompt"].tolist()
    model = build_model(GOLDEN / name, cuda_ops.emulated())
    cache = model.new_kv_cache(-(-len(prompt) // 4), 4)
    batch = build_batch([ScheduledChunk(prompt, 0, list(range(len(cache[0][0]))), True)], 4)
    batch.logits_indices = np.arange(batch.num_tokens, dtype=np.int32)
    logits = model.forward(batch, cache)
    assert np.abs(logits - golden["logits"]).max() <= 1e-4 * np.abs(golden["logits"]).max()


def golden_prefill_logits(model, prompt):
    cache = model.new_kv_cache(-(-len(prompt) // 4), 4)
    batch = build_batch([ScheduledChunk(prompt, 0, list(range(len(cache[0][0]))), True)], 4)
    batch.logits_indices = np.arange(batch.num_tokens, dtype=np.int32)
    return model.forward(batch, cache)


@emulator_only
@pytest.mark.parametrize("name", GOLDEN_MODELS)
def test_device_cuda_emulated_computes_in_the_checkpoints_dtype(name):
    """load_model(device="cuda-emulated") runs a 16-bit checkpoint in its own dtype (the kernels a GPU runs,
    tensor-core prefill attention included) and a float32 one in float32; dtype="float32" asks for the
    exact emulation whatever the checkpoint."""
    golden = np.load(GOLDEN / name / "golden.npz")
    prompt, expected = golden["prompt"].tolist(), golden["logits"]
    model = load_model(GOLDEN / name, device="cuda-emulated")
    assert model.ops.dtype == model.config.dtype
    logits = golden_prefill_logits(model, prompt)
    if model.config.dtype == "float32":
        assert np.abs(logits - expected).max() <= 1e-4 * np.abs(expected).max()
        cpu_logits = golden_prefill_logits(load_model(GOLDEN / name, device="cpu"), prompt)
        np.testing.assert_array_equal(logits.argmax(-1), cpu_logits.argmax(-1))
    else:
        # 16-bit activations against transformers' float32 run of the same weights (as the bf16 test above).
        assert np.abs(logits - expected).max() <= 0.05 * np.abs(expected).max()
        exact = load_model(GOLDEN / name, device="cuda-emulated", dtype="float32")
        assert exact.ops.dtype == "float32"
        assert np.abs(golden_prefill_logits(exact, prompt) - expected).max() <= 1e-4 * np.abs(expected).max()


def test_reference_device_refuses_a_16bit_dtype():
    with pytest.raises(ValueError, match="dtype 'bfloat16' needs device 'cpu', 'cuda' or 'cuda-emulated'"):
        load_model(default_model_dir(), device="reference", dtype="bfloat16")


@pytest.mark.parametrize("make_ops", [cuda_ops.emulated, pytest.param(cuda_ops.gpu, marks=ON_GPU, id="gpu")])
def test_bf16_checkpoint_reaches_the_backend_as_its_own_bits(monkeypatch, make_ops):
    """Weights go from the memory map to the device in the checkpoint's dtype: bit-exact, with no float32
    copy on the host; another activation dtype is converted on the device, rounding to nearest even."""
    path = GOLDEN / "llama_gqa_bf16"
    stored = {name: t.data for name, t in read_checkpoint(path).items()}

    def no_widening(*args):
        raise AssertionError("a bf16 weight was widened to float32 on the way to a bf16 device")

    with monkeypatch.context() as patch:
        patch.setattr(dtypes, "bf16_to_float32", no_widening)
        ops = make_ops("bfloat16")
        model = build_model(path, ops)
    host = ops.launcher.to_host
    attn = "model.layers.1.self_attn."
    qkv = np.concatenate([stored[attn + p + "_proj.weight"] for p in "qkv"])
    assert model.layers[1].qkv_proj.dtype == np.uint16 and np.array_equal(host(model.layers[1].qkv_proj), qkv)
    assert np.array_equal(host(model.lm_head), stored["lm_head.weight"])
    assert np.array_equal(host(model.layers[0].down_proj), stored["model.layers.0.mlp.down_proj.weight"])
    half = build_model(path, make_ops("float16"))
    assert half.layers[1].qkv_proj.dtype == np.float16
    assert np.array_equal(host(half.layers[1].qkv_proj), bf16_to_float32(qkv).astype(np.float16))


@emulator_only
def test_bf16_golden_model_in_bfloat16_on_emulated_kernels():
    golden = np.load(GOLDEN / "llama_gqa_bf16" / "golden.npz")
    prompt = golden["prompt"].tolist()
    model = build_model(GOLDEN / "llama_gqa_bf16", cuda_ops.emulated("bfloat16"))
    cache = model.new_kv_cache(-(-len(prompt) // 4), 4)
    batch = build_batch([ScheduledChunk(prompt, 0, list(range(len(cache[0][0]))), True)], 4)
    batch.logits_indices = np.arange(batch.num_tokens, dtype=np.int32)
    logits = model.forward(batch, cache)
    # bf16 activations against transformers' float32 run of the same bf16 weights: 3.1% of the range
    # (measured).
    assert np.abs(logits - golden["logits"]).max() <= 0.05 * np.abs(golden["logits"]).max()


@emulator_only
def test_engine_hybrid_batches_on_emulated_kernels():
    """The whole engine (Sarathi chunked prefills mixed with decodes, 4-token KV blocks) with
    device="cuda-emulated" (the bundled float32 model computes in float32) generates exactly what it
    generates on NumPy."""
    from minisarathi.llm import LLM
    from minisarathi.sampling_params import SamplingParams

    prompts = ["Once upon a time", "Tom had a red", "Lily and Tom went to the park. They saw"]
    params = SamplingParams(max_tokens=10, temperature=0)

    def generate(device):
        llm = LLM(scheduler="sarathi", chunk_size=8, block_size=4, num_kv_blocks=64, device=device)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params)], llm.engine.model.ops

    expected, ops = generate("cpu")
    assert isinstance(ops, CpuOps)
    tokens, ops = generate("cuda-emulated")
    assert isinstance(ops, cuda_ops.CudaOps) and ops.dtype == "float32"
    assert tokens == expected


def test_a_steps_metadata_goes_up_in_one_copy(monkeypatch):
    """The batch's arrays travel in one packed copy per step, and no upload repeats per layer: the same step
    with one layer or all of them makes the same copies, and gives the reference backend's logits."""
    model = build_model(default_model_dir(), cuda_ops.emulated())
    uploads = []
    to_device = model.ops.launcher.to_device
    monkeypatch.setattr(
        model.ops.launcher, "to_device", lambda a: uploads.append(np.asarray(a).shape) or to_device(a)
    )
    chunks = [
        ScheduledChunk([5, 9, 11], 0, [3, 4], True),
        ScheduledChunk([7], 6, [0, 1], True),
        ScheduledChunk([8], 2, [2], True),
    ]
    batch = build_batch(chunks, 4)
    logits = model.forward(batch, model.new_kv_cache(5, 4))
    all_layers = list(uploads)
    packed = sum(
        -(-a.size // 4) * 4
        for a in (
            batch.input_ids,
            batch.positions,
            batch.slot_mapping,
            batch.query_start,
            batch.context_lens,
            batch.block_tables,
            batch.logits_indices,
        )
    )
    assert all_layers[0] == (packed,)
    assert not any(shape == batch.block_tables.shape for shape in all_layers)  # not uploaded on its own
    uploads.clear()
    model.layers = model.layers[:1]
    model.forward(build_batch(chunks, 4), model.new_kv_cache(5, 4))
    assert uploads == all_layers
    reference = build_model(default_model_dir(), ReferenceOps())
    np.testing.assert_allclose(logits, reference.forward(batch, reference.new_kv_cache(5, 4)), atol=1e-4)


def test_emulated_ops_reject_a_bad_dtype():
    with pytest.raises(ValueError, match="dtype"):
        cuda_ops.emulated("int8")


@ON_GPU
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bundled_model_on_gpu(dtype):
    reference, ref_logits = run_mixed_steps(
        build_model(default_model_dir(), ReferenceOps()), PROMPTS, 6, chunk_size=7
    )
    tokens, logits = run_mixed_steps(
        build_model(default_model_dir(), cuda_ops.gpu(dtype)), PROMPTS, 6, chunk_size=7
    )
    if dtype == "float32":
        assert tokens == reference
        np.testing.assert_allclose(logits, ref_logits, atol=2e-4 * np.abs(ref_logits).max())
    else:
        assert np.abs(logits[:3] - ref_logits[:3]).max() <= 0.06 * np.abs(ref_logits).max()


# ---- sampling on the device ------------------------------------------------------------------------------


def sampling_case(rng, vocab: int):
    """A batch mixing every SamplingParams feature, with histories for the penalties and min_tokens."""
    from minisarathi.sampler import make_generator
    from minisarathi.sampling_params import SamplingParams

    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, logprobs=3),
        SamplingParams(temperature=1.0, seed=7, logprobs=5),
        SamplingParams(temperature=0.7, top_k=5),
        SamplingParams(temperature=1.3, top_p=0.8),
        SamplingParams(temperature=1.0, min_p=0.2),
        SamplingParams(temperature=0.9, top_k=20, top_p=0.5, min_p=0.05, seed=3),
        SamplingParams(
            temperature=0, repetition_penalty=1.8, frequency_penalty=0.5, presence_penalty=0.4, logprobs=0
        ),
        SamplingParams(temperature=1.0, repetition_penalty=0.7, presence_penalty=-1.0),
        SamplingParams(temperature=0, min_tokens=4, stop_token_ids=[11, vocab + 5]),
        SamplingParams(temperature=0.8, min_tokens=2, top_k=1),
    ]
    prompts = [rng.integers(0, vocab, int(rng.integers(1, 12))).tolist() for _ in params]
    outputs = [rng.integers(0, vocab, int(rng.integers(0, 6))).tolist() for _ in params]
    outputs[7] = [int(rng.integers(0, vocab))] * 3 + outputs[7]
    outputs[9], outputs[10] = [4, 5], [6]  # short of min_tokens
    # Distinct values exact in bfloat16 (ties at a top-k or top-p cut are broken arbitrarily by NumPy's sort),
    # and the masked tokens the favourites, so the mask decides the outcome.
    magnitudes = bf16_to_float32(np.arange(0x3F00, 0x4080, dtype=np.uint16))  # every bf16 in [0.5, 4)
    pool = np.concatenate([magnitudes, -magnitudes])
    logits = np.stack([rng.choice(pool, vocab, replace=False) for _ in params]).astype(np.float32)
    logits[9, [11, 2]] = 40.0
    logits[10, 2] = 40.0
    make = lambda: [None if p.seed is None else make_generator(p.seed) for p in params]  # noqa: E731
    return logits, params, make, prompts, outputs


BACKENDS = [
    pytest.param(cuda_ops.emulated, "float32", marks=emulator_only),
    pytest.param(cuda_ops.emulated, "bfloat16", marks=emulator_only),
    pytest.param(cuda_ops.gpu, "bfloat16", marks=ON_GPU, id="gpu-bfloat16"),
]


@pytest.mark.parametrize("ctas_per_row", [None, 3], ids=["one-cta-per-row", "rows-split-over-3-ctas"])
@pytest.mark.parametrize("make_ops, dtype", BACKENDS)
def test_gpu_sampler_matches_the_numpy_sampler(make_ops, dtype, ctas_per_row):
    """Same ids (greedy always; sampled ones given the same uniforms, drawn from the same generators),
    logprobs and ranks as minisarathi.sampler.Sampler, over several steps of both samplers' generators;
    with each row in one CTA (sample_plan's choice at this vocabulary) and split over three."""
    from minisarathi.backends.gpu_sampling import GpuSampler
    from minisarathi.sampler import Sampler

    vocab, eos = 384, (2,)
    ops = make_ops(dtype)
    rng = np.random.default_rng(0)
    logits, params, make_generators, prompts, outputs = sampling_case(rng, vocab)
    device_logits = ops.weight(logits)  # what forward(device_logits=True) leaves on the device
    host_logits = ops.to_numpy(device_logits)  # what the NumPy sampler gets
    reference, on_device = Sampler(vocab, 5, eos), GpuSampler(ops, vocab, 5, eos, ctas_per_row)
    ref_generators, generators = make_generators(), make_generators()
    for _ in range(4):
        want = reference.sample(host_logits, params, ref_generators, prompts, outputs)
        got = on_device.sample(device_logits, params, generators, prompts, outputs)
        np.testing.assert_array_equal(got.token_ids, want.token_ids)
        assert got.token_ids.dtype == np.int64 and got.ranks == want.ranks
        for g, w in zip(got.logprobs, want.logprobs):
            assert (g is None) == (w is None)
            if w is not None:
                assert [t for t, _ in g] == [t for t, _ in w]
                np.testing.assert_allclose([v for _, v in g], [v for _, v in w], rtol=0, atol=1e-6)
    assert want.token_ids[9] not in (11, 2) and want.token_ids[10] != 2  # min_tokens masked the favourites


@emulator_only
def test_gpu_sampler_sends_only_ids_and_logprobs_to_the_host(monkeypatch):
    from minisarathi.backends.gpu_sampling import GpuSampler

    vocab = 384
    ops = cuda_ops.emulated()
    logits, params, make_generators, prompts, outputs = sampling_case(np.random.default_rng(1), vocab)
    sizes = []
    to_host_async = ops.launcher.to_host_async
    monkeypatch.setattr(
        ops.launcher, "to_host_async", lambda xs: sizes.extend(x.size for x in xs) or to_host_async(xs)
    )
    monkeypatch.setattr(ops.launcher, "to_host", None)  # one copy of it all, behind the kernels: no other
    GpuSampler(ops, vocab).sample(ops.weight(logits), params, make_generators(), prompts, outputs)
    # ids of every row, then per logprob row: top ids and logits (5 of the widest), lse, sampled logit, rank
    assert max(sizes) <= len(params) * 5 < vocab and sum(sizes) <= len(params) + 3 * 5 * 2 + 3 * 3


def test_gpu_sampler_rejects_a_wrong_shape():
    from minisarathi.backends.gpu_sampling import GpuSampler
    from minisarathi.sampling_params import SamplingParams

    with pytest.raises(ValueError, match="logits"):
        GpuSampler(cuda_ops.emulated(), 10).sample(
            np.zeros((1, 9), np.float32), [SamplingParams()], [None], [[1]], [[]]
        )


@emulator_only
def test_generation_with_device_logits_and_the_models_sampler_matches_the_reference():
    """forward(device_logits=True) + model.new_sampler(): the engine's loop on either backend, same tokens."""
    from minisarathi.backends.gpu_sampling import GpuSampler
    from minisarathi.sampler import Sampler, make_generator
    from minisarathi.sampling_params import SamplingParams

    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.8, seed=1, logprobs=2)]

    def generate(ops):
        model = build_model(default_model_dir(), ops)
        sampler = model.new_sampler(seed=3, eos_token_ids=(2,))
        generators = [None, make_generator(1)]
        tokens, prompts = [[1, 403, 407], [1, 9]], [[1, 403, 407], [1, 9]]
        cache, table = model.new_kv_cache(8, 4), [[0, 1, 2, 3], [4, 5, 6, 7]]
        done = [0, 0]
        for _ in range(6):
            chunks = [ScheduledChunk(t[d:], d, b, True) for t, d, b in zip(tokens, done, table)]
            done = [len(t) for t in tokens]
            out = sampler.sample(
                model.forward(build_batch(chunks, 4), cache, device_logits=True),
                params,
                generators,
                prompts,
                [t[len(p) :] for t, p in zip(tokens, prompts)],
            )
            for t, token in zip(tokens, out.token_ids):
                t.append(int(token))
        return tokens, type(sampler)

    expected, kind = generate(ReferenceOps())
    assert kind is Sampler
    tokens, kind = generate(cuda_ops.emulated())
    assert kind is GpuSampler and tokens == expected


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_copy_blocks_on_emulated_kernels(dtype):
    """The copy-on-write of parallel sampling: whole blocks copied in every layer, others untouched."""
    ops = cuda_ops.emulated(dtype)
    rng = np.random.default_rng(0)
    shape = (6, 2, 4, 8)  # [num_blocks, Hk, block_size, D]
    host = [
        (
            rng.integers(0, 2**15, shape).astype(ops.activation_dtype),
            rng.integers(0, 2**15, shape).astype(ops.activation_dtype),
        )
        for _ in range(2)
    ]
    kv_cache = [(ops.launcher.to_device(k), ops.launcher.to_device(v)) for k, v in host]
    ops.copy_blocks(kv_cache, [1, 4], [3, 0])
    reference = [(k.copy(), v.copy()) for k, v in host]
    ReferenceOps().copy_blocks(reference, [1, 4], [3, 0])
    for (k, v), (k_ref, v_ref), (k_old, _) in zip(kv_cache, reference, host):
        np.testing.assert_array_equal(ops.launcher.to_host(k), k_ref)
        np.testing.assert_array_equal(ops.launcher.to_host(v), v_ref)
        assert (k_ref[3] == k_old[1]).all() and (k_ref[0] == k_old[4]).all() and (k_ref[2] == k_old[2]).all()


def test_parallel_sampling_on_emulated_kernels(monkeypatch):
    """n > 1 (shared prompt blocks, copy-on-write of the partial one) generates on emulated kernels exactly
    what it generates on NumPy."""
    import minisarathi.engine.engine as engine_module
    from minisarathi.llm import LLM
    from minisarathi.sampling_params import SamplingParams

    params = SamplingParams(n=3, max_tokens=6, temperature=0.9, seed=4)

    def generate():
        llm = LLM(chunk_size=16, block_size=4, num_kv_blocks=64)
        return [[c.token_ids for c in o.outputs] for o in llm.generate(["Tom had a red"], params)]

    expected = generate()
    monkeypatch.setattr(
        engine_module, "load_model", lambda path, **kwargs: build_model(Path(path), cuda_ops.emulated())
    )
    assert generate() == expected
    assert len({tuple(c) for c in expected[0]}) > 1


def test_a_steps_uploads_live_until_the_next_step():
    """The upload cache is emptied only by upload_batch, between steps: emptied mid-step, it would free arrays
    (the packed metadata) that a hybrid step's side-stream kernels may still read on a GPU."""
    ops = cuda_ops.emulated()
    batch = build_batch([ScheduledChunk([5] * 3, 0, [0], True), ScheduledChunk([7], 4, [1], True)], 8)
    ops.upload_batch(batch)
    step = dict(ops._uploads)
    extras = [np.zeros(1, np.int32) for _ in range(40)]  # more derived arrays than any step makes
    for extra in extras:
        ops._upload_once(extra, lambda: extra, "derived")
    assert all(ops._uploads.get(key) is value for key, value in step.items())
    ops.upload_batch(build_batch([ScheduledChunk([9], 2, [2], True)], 8))  # the next step: the old ones go
    assert not any(key in ops._uploads for key in step)
