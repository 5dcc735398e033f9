"""Replicas behind a real load balancer, measured: session affinity against round robin on a multi-turn
workload (prefix-cache hit rate and TTFT), and a rolling restart under continuous load (failed requests).

    python bench/deploy.py --balancers nginx,haproxy --out bench-deploy.json

Needs nginx (with its stream module) and/or HAProxy (Debian: apt-get install nginx libnginx-mod-stream
haproxy) and the HTTP extra. For each balancer: two replicas (both doors, prefix caching on) behind the
recipes of deploy/, then per door a multi-turn run with affinity and one with round robin (the balancer is
restarted in between; each run's conversations are new text), then each replica restarted in turn under load.
docs/deploy.md records a run.

    python bench/deploy.py --proxy-protocol --out bench-proxy.json

instead measures, per balancer and door, what one client guessing keys behind the balancer costs another
key holder behind it, with the PROXY protocol on (the replicas count each client) and off (they count the
balancer): the key holder's seconds, and the guesser's next guess (bench.cluster.brute_force_behind).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minisarathi.bench.cluster import Cluster, ContinuousLoad, brute_force_behind, find_balancer  # noqa: E402
from minisarathi.bench.multiturn import MultiTurnConfig, run_multiturn, summarize_turns  # noqa: E402
from minisarathi.llm import LLM  # noqa: E402
from minisarathi.sampling_params import SamplingParams  # noqa: E402


def affinity_runs(cluster: Cluster, executable: str, config: MultiTurnConfig, repeats: int) -> dict:
    """Per door, `repeats` runs with affinity and as many with round robin, alternated (the machine's load
    drifts; alternating spreads it over both), each with new conversations; the turns of a setting's runs
    are summarized together."""
    results = {}
    for door in ("msgpack", "http"):
        records = {True: [], False: []}
        for _ in range(repeats):
            for affinity in (True, False):
                balancer = cluster.balancers[door]
                balancer.kill()
                balancer.affinity = affinity
                balancer.start(executable)
                config.seed += 1
                records[affinity] += run_multiturn(config, door, balancer.ports[0])
        for affinity in (True, False):
            summary = summarize_turns(records[affinity])
            results[f"{door}/{'affinity' if affinity else 'round_robin'}"] = summary
            print(
                f"  {door:8s} {'affinity' if affinity else 'round robin':12s} hit rate (turns 2+) "
                f"{summary['hit_rate_later_turns']:.3f}  TTFT (turns 2+) p50 "
                f"{summary['ttft_s_later_turns']['p50']:.4f}s mean "
                f"{summary['ttft_s_later_turns']['mean']:.4f}s  "
                f"failed {summary['failed']}",
                flush=True,
            )
    for door in ("msgpack", "http"):  # the balancers keep affinity for the restart that follows
        cluster.balancers[door].kill()
        cluster.balancers[door].affinity = True
        cluster.balancers[door].start(executable)
    return results


def rolling_restart(cluster: Cluster, settle_s: float, model: str | None) -> dict:
    expected = [
        o.outputs[0]
        for o in LLM(model).generate(
            list(ContinuousLoad.PROMPTS), SamplingParams(temperature=0, max_tokens=ContinuousLoad.MAX_TOKENS)
        )
    ]
    started = time.monotonic()
    restarts = []
    with ContinuousLoad(cluster, expected) as load:
        time.sleep(settle_s)
        for index in range(len(cluster.replicas)):
            restarts.append(
                cluster.restart(index)
            )  # back in the balancers' rotation before the next one goes
        time.sleep(settle_s)
    result = {
        "requests_ok": load.done,
        "failed": len(load.failures),
        "failures": load.failures[:20],
        "restarts": restarts,
        "duration_s": time.monotonic() - started,
    }
    print(f"  rolling restart: {load.done} ok, {len(load.failures)} failed", flush=True)
    return result


def brute_force(kind: str, executable: str) -> dict:
    results = {}
    for on in (True, False):
        with tempfile.TemporaryDirectory() as work_dir:
            results["proxy_protocol" if on else "no_proxy_protocol"] = runs = brute_force_behind(
                kind, executable, Path(work_dir), proxy_protocol=on
            )
        for door, seconds in runs.items():
            held = seconds["key_holder_s"]
            print(
                f"  {door:8s} PROXY protocol {'on ' if on else 'off'}: key holder "
                f"{'refused' if held is None else f'{held:.3f}s'}, the guesser's next guess "
                f"{seconds['next_guess_s']:.3f}s",
                flush=True,
            )
    return results


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--balancers", default="nginx,haproxy")
    parser.add_argument(
        "--model", default=None, help="model folder the replicas serve (default: the bundled one)"
    )
    parser.add_argument("--first-message-words", type=int, default=48)
    parser.add_argument(
        "--repeats", type=int, default=1, help="alternated affinity / round-robin runs per door"
    )
    parser.add_argument("--sessions", type=int, default=9, help="odd: see tests/system/test_deploy.py")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--answer-tokens", type=int, default=16)
    parser.add_argument(
        "--settle-s", type=float, default=2.0, help="load before the first restart and after the last"
    )
    parser.add_argument(
        "--proxy-protocol",
        action="store_true",
        help="measure brute force behind the balancer with the PROXY protocol on and off (nothing else)",
    )
    parser.add_argument("--out", default=None, help="JSON file for the results")
    args = parser.parse_args()
    report = {
        "machine": f"{platform.machine()} {platform.system()}, {os.cpu_count()} cores",
        "date": time.strftime("%Y-%m-%d"),
        "command": " ".join(sys.argv),
        "balancers": {},
    }
    for kind in args.balancers.split(","):
        executable = find_balancer(kind)
        if executable is None:
            print(f"{kind}: not installed, skipped", flush=True)
            continue
        print(f"{kind} ({executable}), load average {os.getloadavg()[0]:.1f}", flush=True)
        load_average = {"start": os.getloadavg()}  # 1, 5, 15 minutes: the machine is shared
        if args.proxy_protocol:
            report["balancers"][kind] = {**brute_force(kind, executable), "load_average": load_average}
            continue
        cluster = Cluster(kind, extra_args=(*([args.model] if args.model else []), "--shutdown-grace", "30"))
        try:
            cluster.start(executable)
            config = MultiTurnConfig(
                num_sessions=args.sessions,
                num_turns=args.turns,
                answer_tokens=args.answer_tokens,
                first_message_words=args.first_message_words,
            )
            report["balancers"][kind] = {
                "affinity": affinity_runs(cluster, executable, config, args.repeats),
                "rolling_restart": rolling_restart(cluster, args.settle_s, args.model),
                "load_average": {**load_average, "end": os.getloadavg()},
            }
        finally:
            cluster.close()
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
