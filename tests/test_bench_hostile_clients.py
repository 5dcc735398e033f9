"""bench/hostile_clients.py --engine-only: the bystander beside the attack's requests, and the step's parts."""
import time

from bench.hostile_clients import FORWARD_OPS, STEP_PARTS, engine_steps
from minisarathi.engine.engine import LLMEngine


def test_engine_steps_time_every_part_and_leave_the_engine_as_it_was():
    engine = LLMEngine()
    report = engine_steps(3, True, 80, engine, time.perf_counter, parts=True)
    assert report["bystander_steps"] == [24]   # one token a step whatever the batch
    parts = report["median_parts_ms"]
    assert set(parts) == ({name.lstrip("_") for _, name in STEP_PARTS} | {"op." + op for op in FORWARD_OPS}
                          | {"forward, the model's own lines"})
    assert parts["forward"] >= parts["op.paged_attention"] + parts["op.linear"] > 0
    assert parts["forward, the model's own lines"] >= 0   # the ops are timed inside the forward
    assert parts["sample"] > 0 and parts["update"] > 0
    # the timing wrappers are gone and nothing is left running
    assert not {"linear", "paged_attention"} & set(vars(engine.model.ops))
    assert not {"_forward", "_update"} & set(vars(engine)) and "schedule" not in vars(engine.scheduler)
    assert not engine.has_unfinished_requests() and engine.block_manager.num_used_blocks == 0
