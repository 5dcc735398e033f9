"""Speculative decoding (n-gram prompt lookup, engine/speculative.py) against plain decoding, side by side in
one run on the bundled model, greedy: output tok/s of one stream on two prompts, the acceptance figures, the
ratio tok/s_spec / (mean tokens per verification step x tok/s_plain) (speculation's own cost: 1 when a
verification step costs what a plain step does), and 16 / 64 concurrent streams. Plain and speculative runs
alternate, best of --repeats each (the machine may be shared: the load average is reported).

    python -m bench.speculative [--k 4] [--lookup-max 3] [--lookup-min 1] [--tokens 256] [--repeats 3]

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

from minisarathi import LLM, SamplingParams

PROMPTS = ["Tom had a red ball. Tom had a red ball. He liked to", "Once upon a time"]
# 16 / 64 streams: different openings, so the batch mixes streams that repeat and streams that do not
STREAM_PROMPTS = [
    "Once upon a time",
    "Tom had a red ball. Tom had a red ball. He liked to",
    "Lily and Tom went to the park.",
    "One day, a little girl named Sue",
    "The cat sat on the mat. The cat",
    "Ben wanted to fly a kite.",
    "There was a big tree in the garden.",
    'Mom said, "Let\'s bake a cake."',
]


def timed(llm: LLM, prompts: list[str], params: SamplingParams) -> tuple[float, int, int]:
    """(seconds, tokens generated, engine steps) of one generate call."""
    steps = len(llm.engine.step_records)
    began = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - began
    return seconds, sum(len(o.outputs[0].token_ids) for o in outs), len(llm.engine.step_records) - steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--lookup-max", type=int, default=3)
    parser.add_argument("--lookup-min", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=256, help="tokens per single stream")
    parser.add_argument("--stream-tokens", type=int, default=128, help="tokens per stream of 16 / 64")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--blas-threads",
        type=int,
        default=os.cpu_count(),
        help="the same for both engines (default: all CPUs)",
    )
    args = parser.parse_args()
    config = {
        "method": "ngram",
        "num_speculative_tokens": args.k,
        "prompt_lookup_max": args.lookup_max,
        "prompt_lookup_min": args.lookup_min,
    }
    plain = LLM(blas_threads=args.blas_threads)
    spec = LLM(speculative_config=config, blas_threads=args.blas_threads)
    result = {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load_average_before": os.getloadavg(),
        "speculative_config": config,
        "single_stream": [],
        "streams": [],
    }
    for prompt in PROMPTS:
        params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
        assert plain.generate(prompt, params)[0].outputs[0].token_ids == (
            spec.generate(prompt, params)[0].outputs[0].token_ids
        ), "speculation changed the greedy output"
        best = {"plain": None, "spec": None}
        before = spec.engine.stats()["spec_decode"]
        for _ in range(args.repeats):
            for name, llm in (("plain", plain), ("spec", spec)):
                run = timed(llm, [prompt], params)
                if best[name] is None or run[0] < best[name][0]:
                    best[name] = run
        after = spec.engine.stats()["spec_decode"]
        drafts = after["num_drafts"] - before["num_drafts"]
        accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
        (t_plain, n, _), (t_spec, _, spec_steps) = best["plain"], best["spec"]
        # decode steps: all but the prefill step, which emits the first token
        per_step = (n - 1) / (spec_steps - 1)
        plain_rate, spec_rate = n / t_plain, n / t_spec
        result["single_stream"].append(
            {
                "prompt": prompt,
                "tokens": n,
                "plain_tok_s": round(plain_rate, 1),
                "spec_tok_s": round(spec_rate, 1),
                "speedup": round(spec_rate / plain_rate, 3),
                "tokens_per_step": round(per_step, 3),
                "verifications_per_run": drafts / args.repeats,
                "accepted_per_verification": round(accepted / drafts, 3) if drafts else None,
                "draft_tokens_per_verification": round(
                    (after["num_draft_tokens"] - before["num_draft_tokens"]) / drafts, 3
                )
                if drafts
                else None,
                "cost_ratio": round(spec_rate / (per_step * plain_rate), 3),
            }
        )
    for streams in (16, 64):
        prompts = [STREAM_PROMPTS[i % len(STREAM_PROMPTS)] for i in range(streams)]
        params = SamplingParams(temperature=0, max_tokens=args.stream_tokens, ignore_eos=True)
        best = {"plain": None, "spec": None}
        before = spec.engine.stats()["spec_decode"]["num_drafts"]
        for _ in range(args.repeats):
            for name, llm in (("plain", plain), ("spec", spec)):
                run = timed(llm, prompts, params)
                if best[name] is None or run[0] < best[name][0]:
                    best[name] = run
        (t_plain, n, _), (t_spec, _, _) = best["plain"], best["spec"]
        drafts = spec.engine.stats()["spec_decode"]["num_drafts"] - before
        result["streams"].append(
            {
                "streams": streams,
                "tokens": n,
                "plain_tok_s": round(n / t_plain, 1),
                "spec_tok_s": round(n / t_spec, 1),
                "speedup": round(t_plain / t_spec, 3),
                "verifications_per_run": drafts / args.repeats,
            }
        )
    result["load_average_after"] = os.getloadavg()
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
