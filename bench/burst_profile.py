"""Where the CPU time of bench/peers.py's burst goes in `LLM.generate`: per backend op and engine phase.

    python -m bench.burst_profile                       # the bundled model
    python -m bench.burst_profile /work/peers/models/small --blas-threads 1 --rounds 2

Runs the burst (32 requests x 128 prompt tokens x 64 output tokens, greedy, EOS ignored) through an engine
whose backend ops and step phases are wrapped in thread-CPU timers, after one untimed round (buffers grown,
pages touched). Decode attention (a batch of decodes only) and attention in steps with prefill chunks are
told apart. Thread CPU time: steadier than wall time on a shared machine, and the process is
single-threaded at one BLAS thread. Prints one JSON line, then a table; the share of the matmuls is the
floor any float32 implementation shares (docs/performance.md).
"""
from __future__ import annotations

import argparse
import json
import time
from collections import Counter

from minisarathi import LLM, SamplingParams
from minisarathi.bench.workloads import WorkloadConfig, make_workload

BURST = dict(num_requests=32, prompt_len=128, decode_len=64)
OPS = ("embedding", "rms_norm", "add_rms_norm", "linear", "rope_store_kv", "paged_attention", "silu_and_mul")
PHASES = ("_advance", "_make_batch", "_update")


def instrument(llm: LLM, spent: Counter) -> None:
    """Wraps the backend's ops, the engine's phases, the scheduler and the sampler in thread-CPU timers.
    Nested ops (add_rms_norm calls rms_norm) are counted once, under the outer one."""
    engine, clock = llm.engine, time.thread_time_ns
    depth = [0]

    def timed(name, fn, attention=False):
        def wrapper(*args, **kwargs):
            if depth[0]:
                return fn(*args, **kwargs)
            key = name
            if attention:   # args: q, k_cache, v_cache, batch, scale
                key += " (decode batch)" if args[3].max_query_len == 1 else " (with prefill chunks)"
            depth[0] += 1
            start = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[key] += clock() - start
                depth[0] -= 1
        return wrapper

    ops = engine.model.ops
    for name in OPS:
        setattr(ops, name, timed(name, getattr(ops, name), attention=name == "paged_attention"))
    for name in PHASES:
        setattr(engine, name, timed(f"engine.{name}", getattr(engine, name)))
    engine.scheduler.schedule = timed("scheduler.schedule", engine.scheduler.schedule)
    engine.sampler.launch = timed("sampler.launch", engine.sampler.launch)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default=None, help="HF folder (default: the bundled stories260K)")
    parser.add_argument("--blas-threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=1, help="timed bursts, summed")
    args = parser.parse_args()
    llm = LLM(args.model, blas_threads=args.blas_threads)
    prompts = [s.prompt_token_ids for s in make_workload(WorkloadConfig(lengths="fixed", arrivals="static",
                                                                          **BURST))]
    params = SamplingParams(max_tokens=BURST["decode_len"], temperature=0.0, ignore_eos=True)
    llm.generate(prompts, params)           # untimed: buffers grown, pages touched
    spent: Counter = Counter()
    instrument(llm, spent)
    start = time.thread_time_ns()
    for _ in range(args.rounds):
        llm.generate(prompts, params)
    total = time.thread_time_ns() - start
    spent["other (engine step, generate loop)"] = total - sum(spent.values())
    tokens = args.rounds * BURST["num_requests"] * BURST["decode_len"]
    print(json.dumps({"model": args.model or "stories260K", "blas_kernels": llm.engine.cpu_setup.blas_kernels,
                      "output_tok_per_cpu_s": round(tokens / total * 1e9, 1),
                      "ms": {k: round(v / 1e6, 1) for k, v in spent.most_common()}}))
    print(f"\n{tokens} output tokens in {total / 1e9:.3f} s of CPU ({tokens / total * 1e9:.0f} tok/CPU-s); "
          f"OpenBLAS: {llm.engine.cpu_setup.blas_kernels}")
    for name, ns in spent.most_common():
        print(f"{name:40} {ns / 1e6:9.1f} ms {100 * ns / total:6.1f}%")


if __name__ == "__main__":
    main()
