"""bench/burst_steps.py runs the whole burst and reads the steps it is made of."""
import numpy as np

from bench.burst_steps import BURST, run_round
from minisarathi.engine.engine import LLMEngine


def test_the_burst_runs_every_prompt_token_once_and_every_decode_row():
    engine = LLMEngine(chunk_size=512)
    records, cpu_seconds = run_round(engine, 0, np.random.default_rng(0))
    assert len(cpu_seconds) == len(records) and min(cpu_seconds) > 0   # one record and one CPU time per step
    prompt_tokens = BURST["num_requests"] * BURST["prompt_len"]
    assert sum(r.num_prefill_tokens for r in records) == prompt_tokens
    # the first token of each request comes from its last prefill chunk, the other decode_len - 1 from decode rows
    assert sum(r.num_decode_tokens for r in records) == BURST["num_requests"] * (BURST["decode_len"] - 1)
    assert all(r.num_prefill_tokens + r.num_decode_tokens <= 512 for r in records)   # the Sarathi budget
    assert not engine.has_unfinished_requests()
