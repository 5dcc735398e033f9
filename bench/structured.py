"""The host's cost of structured outputs per step (minisarathi/structured.py): llguidance's bitmask for 1, 8
and 32 constrained rows, then the bitmask applied to float32 logits (the native CPU kernel, or NumPy with
MINISARATHI_CPU_SAMPLING=0), at the vocabulary of the tokenizer given (a model folder or a GGUF file; the
bundled stories260K by default, 512 tokens; llama.cpp's ggml-vocab-llama-bpe.gguf is Llama 3's 128k).

Each row walks its JSON schema with a random allowed token a step (a fresh matcher once one completes), so
the masks are those of real positions in the output: inside strings, between keys, in numbers.

What the masks add to a step, as the SLO cost model prices it (engine/cost_model.py): on the CPU the whole
total; on the CUDA backend under overlap the bitmask is computed on the host while the device runs the
forward (the kernel applies it there), so only max(0, bitmask - forward) shows, for each modeled forward
time given with --forward-ms (the emulator runs kernels on the host, so the real overlap is not timed here).

    python -m bench.structured [--tokenizer PATH] [--rows 1 8 32] [--steps 100] [--forward-ms 0.5 3.7]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from minisarathi import structured
from minisarathi.engine.cost_model import CostModel
from minisarathi.paths import default_model_dir
from minisarathi.sampling_params import SamplingParams
from minisarathi.tokenizer import Tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z]+\\.(com|org)$"},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 16}, "zip": {"type": "string"}},
            "required": ["city"],
        },
    },
    "required": ["name", "age", "tags", "address"],
}


class Row:
    """A constrained sequence without a model: only its matcher."""

    def __init__(self, params, tokenizer, vocab):
        self.new = lambda: structured.matcher(params, tokenizer, vocab)
        self.matcher = self.new()


def run(tokenizer, vocab: int, rows: int, steps: int, rng: np.random.Generator) -> tuple[float, float]:
    """Median seconds per step of the bitmask and of its application, for `rows` constrained rows."""
    params = SamplingParams(structured={"json": SCHEMA})
    batch = [Row(params, tokenizer, vocab) for _ in range(rows)]
    logits = rng.standard_normal((rows, vocab)).astype(np.float32)  # float32[R, V]
    where = np.arange(rows)
    mask_s, apply_s = [], []
    for step in range(steps + 5):  # the first 5 warm up
        began = time.perf_counter()
        bitmask = structured.compute_bitmask([r.matcher for r in batch], vocab)
        masked = time.perf_counter()
        structured.apply_token_bitmask(logits, where, bitmask)
        applied = time.perf_counter()
        if step >= 5:
            mask_s.append(masked - began)
            apply_s.append(applied - masked)
        allowed = np.unpackbits(bitmask.view(np.uint8), axis=1, count=vocab, bitorder="little")
        for i, row in enumerate(batch):
            row.matcher.consume_token(int(rng.choice(np.flatnonzero(allowed[i]))))
            if row.matcher.is_stopped() or row.matcher.is_error():
                row.matcher = row.new()
    return float(np.median(mask_s)), float(np.median(apply_s))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokenizer", default=str(default_model_dir()), help="model folder or GGUF file")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument(
        "--forward-ms", type=float, nargs="*", default=[0.5, 3.7], help="modeled GPU forwards (ms)"
    )
    args = parser.parse_args(argv)
    overlapped = CostModel(overlapped=True)
    tokenizer = Tokenizer.from_pretrained(args.tokenizer)
    vocab = tokenizer.vocab_size
    rng = np.random.default_rng(0)
    print(f"vocabulary {vocab} tokens; median per step over {args.steps} steps")
    shown = [f"{f'adds us @{f:g} ms':>16}" for f in args.forward_ms]
    print(f"{'rows':>5} {'bitmask us':>11} {'apply us':>9} {'total us':>9} {'us per row':>11}", *shown)
    for rows in args.rows:
        mask_s, apply_s = run(tokenizer, vocab, rows, args.steps, rng)
        total = (mask_s + apply_s) * 1e6
        adds = [f"{overlapped.added_mask_time(mask_s, f / 1e3) * 1e6:16.0f}" for f in args.forward_ms]
        print(f"{rows:5} {mask_s * 1e6:11.0f} {apply_s * 1e6:9.0f} {total:9.0f} {total / rows:11.1f}", *adds)


if __name__ == "__main__":
    main()
