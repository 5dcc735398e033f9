"""Host time against the wait for the sampled ids per engine step, with overlap off and on (issue 11).

    nice python -m bench.step_timeline                  # JSON lines, then a table
    nice python -m bench.step_timeline --batches 1 32 --steps 40

The engine runs the bundled stories260K, B requests decoding together (short prompts, ignore_eos, detokenize
off so that any ids will do), and each decode-only step's StepRecord gives its host time and its wait for
ids (host_time + ids_wait_time = step_time). Three backends:
  - numpy: the reference, synchronous: the compute is host time, the wait is about 0.
  - null: the CUDA backend's wrappers (eager: no CUDA graphs) over a launcher whose kernels and matmuls cost nothing (SimulatedStream
    below with free launches), so the step is only the host's work: scheduling, batch building, issuing the forward and the
    sampling (the Python of every launch), outputs. This is what overlap must hide under the GPU's time.
  - simulated: the same, over a model of one CUDA stream: every kernel or matmul the host issues takes
    --launch-us of device time, back to back in issue order, while the host goes on; the sampler's ids copy
    waits for the launches issued before it (as a CUDA event does). This is not a GPU: it shows, on the CPU,
    that overlap puts the host's work under the device's instead of after it.
Per backend and batch: medians over the decode-only steps of host time, ids wait, step time, and (simulated)
the device time issued per step, each column its own median.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from bench.step_launches import NullLauncher
from minisarathi.engine.engine import LLMEngine
from minisarathi.sampling_params import SamplingParams


class SimulatedStream(NullLauncher):
    """One CUDA stream whose every kernel or matmul takes `launch_seconds`: a launch issued at time t starts when
    the stream is free (or at t) and ends `launch_seconds` later; issuing returns at once. to_host_async's wait
    returns when the launches issued before it are done (spinning, as CuPy's event synchronize does)."""

    def __init__(self, launch_seconds: float):
        self.launch_seconds = launch_seconds
        self.free_at = 0.0            # time.perf_counter() when the launches issued so far are done
        self.busy_seconds = 0.0       # device time issued so far

    def _issue(self) -> None:
        self.free_at = max(self.free_at, time.perf_counter()) + self.launch_seconds
        self.busy_seconds += self.launch_seconds

    def kernel(self, file: str, name: str):
        return lambda grid, block, args, shared_mem=0: self._issue()

    def matmul_t(self, x, w, bias):
        self._issue()
        return super().matmul_t(x, w, bias)

    def to_host_async(self, arrays):
        done_at = self.free_at

        def wait():
            while time.perf_counter() < done_at:
                pass
            # what the kernels would have written: zeros (a valid token id; the forward checks host ids)
            return [np.zeros(a.shape, a.dtype) for a in arrays]
        return wait


def engine_for(backend: str, overlap: bool, launch_us: float) -> tuple[LLMEngine, SimulatedStream | None]:
    """numpy: the NumPy backend; null and simulated: the CUDA backend's wrappers over a SimulatedStream whose
    launches take 0 or launch_us."""
    device = "cpu" if backend == "numpy" else "cuda-emulated"
    # Eager: the stream model times each launch the host issues, and a replayed CUDA graph issues none.
    engine = LLMEngine(device=device, overlap=overlap, num_kv_blocks=1024, block_size=16, max_num_seqs=256,
                       cuda_graphs=False)
    stream = None
    if backend != "numpy":   # the wrappers, the sampler and the batch path stay; only the launches change
        stream = SimulatedStream(launch_us * 1e-6 if backend == "simulated" else 0.0)
        engine.model.ops.launcher = stream
    return engine, stream


def measure(backend: str, overlap: bool, batch: int, steps: int, launch_us: float) -> dict:
    engine, stream = engine_for(backend, overlap, launch_us)
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True, detokenize=False)
    for i in range(batch):
        engine.add_request(str(i), [1, 3 + i % 500, 300, 301, 302, 303, 304, 305], params)
    busy = []
    while engine.has_unfinished_requests():
        before = stream.busy_seconds if stream else 0.0
        engine.step()
        if stream and stream.launch_seconds:
            busy.append(stream.busy_seconds - before)
    records = list(engine.step_records)
    decode = [i for i, r in enumerate(records) if r.num_prefill_tokens == 0 and r.num_seqs == batch]
    # Medians, each of its own column: on a shared machine a step that loses the CPU makes a mean meaningless.
    median = lambda values: 1e3 * statistics.median(values)   # noqa: E731  ms
    row = {"backend": backend, "overlap": overlap, "batch": batch, "decode_steps": len(decode),
           "host_ms": median(records[i].host_time for i in decode),
           "ids_wait_ms": median(records[i].ids_wait_time for i in decode),
           "step_ms": median(records[i].step_time for i in decode),
           "schedule_ms": median(records[i].schedule_time for i in decode)}
    if busy:   # device time issued by each step() call
        row["device_ms"] = median(busy[i] for i in decode)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--steps", type=int, default=30, help="tokens per request")
    parser.add_argument("--launch-us", type=float, default=20.0, help="simulated device time per launch")
    parser.add_argument("--backends", nargs="+", default=["numpy", "null", "simulated"])
    args = parser.parse_args()
    rows = []
    for backend in args.backends:
        for batch in args.batches:
            for overlap in (False, True):
                row = measure(backend, overlap, batch, args.steps, args.launch_us)
                rows.append(row)
                print(json.dumps(row), flush=True)
    print(f"\n{'backend':10s} {'batch':>5s} {'overlap':>7s} {'host ms':>8s} {'ids wait ms':>11s} {'step ms':>8s} "
          f"{'device ms':>9s}   (medians over the decode steps)")
    for r in rows:
        device = f"{r['device_ms']:9.2f}" if "device_ms" in r else f"{'-':>9s}"
        print(f"{r['backend']:10s} {r['batch']:5d} {'on' if r['overlap'] else 'off':>7s} {r['host_ms']:8.2f} "
              f"{r['ids_wait_ms']:11.2f} {r['step_ms']:8.2f} {device}")


if __name__ == "__main__":
    main()
