"""CPU cost of one engine step outside the model: scheduling, batch building, sampling, bookkeeping, outputs.

The bundled model is loaded (for its tokenizer and config) and then replaced by a stub whose forward pass
returns rows of a precomputed random logits table, so what is timed is everything the engine does
around the model. N greedy requests are prefilled, then `--steps` decode steps with all N running are
timed, in three modes that add the per-token costs one at a time:

    core     detokenize=False, stream=False: scheduling, batch, sampling, token bookkeeping (LLM.generate's
             output mode, without text)
    stream   detokenize=False: plus one RequestOutput per sequence per step (a copy of its token ids)
    text     the defaults: plus incremental detokenization of every token (what a streaming server pays)

    python -m bench.scheduler_overhead                      # N = 32, 256, 1024
    python -m bench.scheduler_overhead --sizes 256 --steps 200 --scheduler vllm --modes core
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from minisarathi.engine.engine import LLMEngine
from minisarathi.sampling_params import SamplingParams


CONTEXT = 512   # the bundled model's max_position_embeddings


class RandomLogitsModel:
    """Stands in for the model: float32[N, vocab] random logits, at the cost of a slice."""

    def __init__(self, config, max_rows: int, seed: int = 0):
        self.config = config
        self.table = np.random.default_rng(seed).standard_normal((2 * max_rows, config.vocab_size), np.float32)
        self.offset = 0

    def forward(self, batch, kv_cache, device_logits=False):
        n = len(batch.logits_indices)
        self.offset = (self.offset + 1) % (len(self.table) - n)   # different logits every step
        return self.table[self.offset:self.offset + n]


MODES = {"core": (False, False), "stream": (False, True), "text": (True, True)}   # mode: (detokenize, stream)


def measure(num_seqs: int, steps: int, prompt_len: int, scheduler: str, block_size: int, mode: str) -> dict:
    # A budget of 2N tokens: N decodes plus room to finish the prefills of the last ones quickly.
    engine = LLMEngine(scheduler=scheduler, chunk_size=max(512, 2 * num_seqs), block_size=block_size,
                       max_num_seqs=num_seqs, num_kv_blocks=num_seqs * -(-CONTEXT // block_size))
    max_tokens = CONTEXT - prompt_len   # outlasts warm-up + timed steps (checked below)
    engine.model = RandomLogitsModel(engine.model_config, num_seqs)
    rng = np.random.default_rng(1)
    detokenize, stream = MODES[mode]
    for i in range(num_seqs):   # one SamplingParams per request, as the server makes them
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, detokenize=detokenize)
        engine.add_request(str(i), rng.integers(3, engine.model_config.vocab_size, prompt_len).tolist(), params,
                           stream=stream)
    while any(s.in_prefill or s.status.value == "waiting" for s in engine.requests.values()):
        engine.step()
    first = len(engine.step_records)
    cpu, wall = [], []
    for _ in range(steps):
        # CPU time of this thread, so that a busy machine running someone else does not count; wall beside it
        start_cpu, start_wall = time.thread_time(), time.perf_counter()
        engine.step()
        cpu.append(time.thread_time() - start_cpu)
        wall.append(time.perf_counter() - start_wall)
    records = engine.step_records[first:]
    assert all(r.num_decode_tokens == num_seqs for r in records), "not every sequence decoded every step"
    return {
        "running": num_seqs,
        "mode": mode,
        "scheduler": scheduler,
        "steps": steps,
        "cpu_ms_median": 1e3 * statistics.median(cpu),
        "cpu_ms_mean": 1e3 * statistics.fmean(cpu),
        "wall_ms_median": 1e3 * statistics.median(wall),
        # wall-clock parts from the engine's step records: scheduling + batch building, sampling (stub ~ 0)
        "schedule_ms": 1e3 * statistics.median(r.schedule_time for r in records),
        "sample_ms": 1e3 * statistics.median(r.execution_time for r in records),
        "cpu_us_per_seq": 1e6 * statistics.median(cpu) / num_seqs,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[32, 256, 1024])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--scheduler", default="sarathi")
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    args = parser.parse_args()
    rows = []
    for n in args.sizes:
        for mode in args.modes:
            rows.append(measure(n, args.steps, args.prompt_len, args.scheduler, args.block_size, mode))
            print(json.dumps(rows[-1]), flush=True)
    print("\n| running | mode | CPU ms/step | wall ms/step | schedule + batch (wall ms) | sampling (wall ms) "
          "| CPU us/seq |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['running']} | {r['mode']} | {r['cpu_ms_median']:.2f} | {r['wall_ms_median']:.2f} "
              f"| {r['schedule_ms']:.2f} | {r['sample_ms']:.2f} | {r['cpu_us_per_seq']:.1f} |")


if __name__ == "__main__":
    main()
