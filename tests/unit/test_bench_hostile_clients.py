"""bench/hostile_clients.py: a scenario against a server with the server's step times; --engine-only: the
bystander beside the attack's requests, and the step's parts."""

import json
import time

from bench.hostile_clients import FORWARD_OPS, STEP_PARTS, engine_steps, main
from minisarathi.engine.engine import LLMEngine
from minisarathi.engine.step_log import StepRecord, step_time_summary


def test_step_time_summary_counts_each_step_once_by_kind():
    def record(ms, num_seqs, prefill_tokens):
        return StepRecord(
            0.0,
            num_seqs,
            prefill_tokens,
            num_seqs,
            0,
            0.0,
            0.0,
            ms / 1000,
            0,
            0,
            None,
            None,
            None,
            False,
            ms / 1000,
            0.0,
        )

    steps = [record(ms, 9, 0) for ms in (0.7, 0.8, 0.75, 0.72)] + [
        record(1.3, 7, 0),
        record(1.1, 7, 0),
        record(1.6, 8, 5),
        record(0.9, 9, 0),
    ]
    summary = step_time_summary(steps)
    assert summary["steps"] == 8 and summary["max_ms"] == 1.6 and summary["p50_ms"] == 0.85
    assert summary["decode_by_num_seqs"] == {"7": [2, 1.2], "9": [5, 0.75]}
    assert summary["prefill"] == [1, 1.6]
    assert step_time_summary([]) == {"steps": 0}


def test_a_scenario_reports_the_servers_steps_beside_the_bystanders_latency(capsys):
    """Alone the bystander's steps run one sequence; beside the stop_lists attack (8 in flight) at most 9."""
    assert main(["--scenarios", "stop_lists", "--samples", "3"]) == 0
    idle, report = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert idle["scenario"] == "idle" and report["scenario"] == "stop_lists" and report["attack_errors"] == 0
    assert report["kv_blocks_used_after"] == 0 and report["pending_after"] == 0
    alone, during = report["server_steps"]["idle_before"], report["server_steps"]["during"]
    assert set(alone["decode_by_num_seqs"]) == {"1"} and alone["prefill"][0] == 3  # one per generate
    assert max(map(int, during["decode_by_num_seqs"])) <= 9 and during["prefill"][0] >= 3
    for summary in (alone, during):
        assert (
            summary["steps"]
            == sum(n for n, _ in summary["decode_by_num_seqs"].values()) + summary["prefill"][0]
        )


def test_engine_steps_time_every_part_and_leave_the_engine_as_it_was():
    engine = LLMEngine()
    report = engine_steps(3, True, 80, engine, time.perf_counter, parts=True)
    assert report["bystander_steps"] == [24]  # one token a step whatever the batch
    parts = report["median_parts_ms"]
    assert set(parts) == (
        {name.lstrip("_") for _, name in STEP_PARTS}
        | {"op." + op for op in FORWARD_OPS}
        | {"forward, the model's own lines"}
    )
    assert parts["forward"] >= parts["op.paged_attention"] + parts["op.linear"] > 0
    assert parts["forward, the model's own lines"] >= 0  # the ops are timed inside the forward
    assert parts["sample"] > 0 and parts["update"] > 0
    # the timing wrappers are gone and nothing is left running
    assert not {"linear", "paged_attention"} & set(vars(engine.model.ops))
    assert not {"_forward", "_update"} & set(vars(engine)) and "schedule" not in vars(engine.scheduler)
    assert not engine.has_unfinished_requests() and engine.block_manager.num_used_blocks == 0
