"""The steps of bench/peers.py's burst, as the engine ran them: which ones make the clients' TBT P99.

    python -m bench.burst_steps                          # the bundled model
    python -m bench.burst_steps --clock cpu              # CPU time per step, on a loaded machine
    env -u OPENBLAS_CORETYPE taskset -c 1 python -m bench.burst_steps /work/peers/models/small --rounds 2

Runs the burst (32 requests x 128 prompt tokens x 64 output tokens, greedy, EOS ignored) through a fresh
engine, `--rounds` times back to back (the first round is a fresh server's first burst), and reads the
engine's step records. Every decode row of a step is one time-between-tokens sample of that step's length,
so the engine's share of the clients' TBT P99 is the P99 of step times weighted by their decode rows; next to
it, the median step with prompt tokens and the slowest decode-only step of the same round say whether one
step stands out (the machine's load moves all of them together). Prints one JSON line per step with prompt
tokens, then one per round, then a table.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

from minisarathi.engine.engine import LLMEngine
from minisarathi.sampling_params import SamplingParams

BURST = dict(num_requests=32, prompt_len=128, decode_len=64)


def run_round(engine: LLMEngine, round_index: int, rng: np.random.Generator) -> tuple[list, list[float]]:
    """The round's step records, and each step's CPU time (the process's, in seconds, around engine.step)."""
    params = SamplingParams(temperature=0, max_tokens=BURST["decode_len"], ignore_eos=True)
    vocab = engine.model_config.vocab_size
    for i in range(BURST["num_requests"]):
        engine.add_request(f"{round_index}-{i}", rng.integers(3, vocab, BURST["prompt_len"]).tolist(), params)
    first = len(engine.step_records)
    cpu_seconds = []
    while engine.has_unfinished_requests():
        began = time.process_time()
        engine.step()
        cpu_seconds.append(time.process_time() - began)
    return list(engine.step_records)[first:], cpu_seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default=None, help="a model folder (default: the bundled one)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--blas-threads", type=int, default=1)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="step times from the engine's records (wall clock), or the process's CPU time around "
                             "each step, which a loaded machine disturbs less")
    args = parser.parse_args()
    engine = LLMEngine(args.model, blas_threads=args.blas_threads)
    rng = np.random.default_rng(0)
    summaries = []
    for r in range(args.rounds):
        records, cpu_seconds = run_round(engine, r, rng)
        step_ms = [(rec.step_time if args.clock == "wall" else cpu) * 1e3 for rec, cpu in zip(records, cpu_seconds)]
        for record, ms in zip(records, step_ms):
            if record.num_prefill_tokens:
                print(json.dumps({"round": r, "prefill_tokens": record.num_prefill_tokens,
                                  "decode_rows": record.num_decode_tokens, "step_ms": ms}))
        times = np.repeat(step_ms, [rec.num_decode_tokens for rec in records])
        decode_only = [ms for rec, ms in zip(records, step_ms) if not rec.num_prefill_tokens]
        with_prefill = [ms for rec, ms in zip(records, step_ms) if rec.num_prefill_tokens]
        summary = {"round": r, "clock": args.clock, "steps": len(records), "steps_with_prefill": len(with_prefill),
                   "with_prefill_median_ms": float(np.median(with_prefill)),
                   "decode_only_median_ms": float(np.median(decode_only)),
                   "decode_only_max_ms": max(decode_only),
                   "tbt_p50_ms": float(np.percentile(times, 50)), "tbt_p99_ms": float(np.percentile(times, 99)),
                   "slowest_step_ms": max(step_ms)}
        print(json.dumps(summary), flush=True)
        summaries.append(summary)
    print(f"\nstep times: {args.clock} clock")
    print(f"{'round':>5} {'steps':>5} {'w/ prefill':>10} {'its p50 ms':>10} {'decode-only p50 ms':>18} "
          f"{'max ms':>6} {'TBT p50 ms':>10} {'TBT p99 ms':>10} {'slowest ms':>10}")
    for s in summaries:
        print(f"{s['round']:5d} {s['steps']:5d} {s['steps_with_prefill']:10d} {s['with_prefill_median_ms']:10.1f} "
              f"{s['decode_only_median_ms']:18.1f} {s['decode_only_max_ms']:6.1f} {s['tbt_p50_ms']:10.1f} "
              f"{s['tbt_p99_ms']:10.1f} {s['slowest_step_ms']:10.1f}")


if __name__ == "__main__":
    main()
