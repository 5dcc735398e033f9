"""The engine's side of tensor parallelism: TensorParallelModel starts N rank processes and stands in for
LlamaModel (same methods the engine calls); each forward sends the step's batch to rank 0, which broadcasts
it, and gets the logits back.

The engine's process is not an MPI rank itself: under MPICH's process manager (hydra) a rank that dies takes
every process of its job down with it, the spawning one included (measured with MPI_Comm_spawn, with and
without -disable-auto-cleanup), so an engine inside the job could not report the failure. Instead it starts
`mpiexec -n N` as a child process and talks to rank 0 over a Unix socket; when a rank dies, hydra ends the
group, the engine sees the socket close and the group's exit, and fails the step with the group's own report.
A rank that hangs is caught by rank_timeout_s: no answer in time and the group is killed.
"""

from __future__ import annotations

import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np

from minisarathi.backends.devices import resolve_device
from minisarathi.batch import Batch
from minisarathi.config import ModelConfig
from minisarathi.parallel.sharding import check_tensor_parallel, shard_config
from minisarathi.sampler import Sampler

MPI_INSTALL = "pip install 'minisarathi[mpi]'"
STARTUP_TIMEOUT_S = 600.0  # every rank loads its shard before the group answers
_POLL_S = 0.05


class TensorParallelError(RuntimeError):
    """The rank group died, hung, or could not start; the model cannot run any more."""


def find_mpiexec() -> str:
    """The mpiexec of the MPI library mpi4py uses (MPICH from PyPI puts it beside the interpreter)."""
    try:
        import mpi4py  # noqa: F401  (only its presence is checked here; the ranks import MPI)
    except ImportError:
        raise ValueError(f"tensor_parallel_size > 1 needs MPI (mpi4py and MPICH): {MPI_INSTALL}") from None
    for folder in (sysconfig.get_path("scripts"), os.path.dirname(sys.executable)):
        candidate = Path(folder) / "mpiexec"
        if candidate.is_file():
            return str(candidate)
    found = shutil.which("mpiexec")
    if found is None:
        raise ValueError(f"tensor_parallel_size > 1 needs an mpiexec (MPICH's, from PyPI): {MPI_INSTALL}")
    return found


class TensorParallelModel:
    def __init__(self, model_dir: str | Path, device: str, dtype: str, size: int, rank_timeout_s: float):
        """device and dtype as load_model takes them, for every rank; size ranks."""
        self.config = ModelConfig.from_pretrained(model_dir)
        check_tensor_parallel(self.config, size)
        self.size = size
        self.rank_timeout_s = rank_timeout_s
        self._rank_config = shard_config(self.config, size)
        self._failure: TensorParallelError | None = None
        self._ranks: list[
            dict
        ] = []  # per rank: rank, pid, host, device, free_memory_bytes, weight_bytes/format (once started)
        mpiexec = find_mpiexec()
        self._dir = tempfile.TemporaryDirectory(prefix="minisarathi-tp-")
        address = os.path.join(self._dir.name, "rank0.sock")
        self._log_path = os.path.join(self._dir.name, "ranks.log")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(address)
        listener.listen(1)
        listener.settimeout(_POLL_S)
        package_root = str(Path(__file__).resolve().parents[2])  # where `minisarathi` imports from
        threads = str(
            max(1, (os.cpu_count() or 1) // size)
        )  # N ranks share the cores instead of each taking all
        env = {
            "OMP_NUM_THREADS": threads,
            "OPENBLAS_NUM_THREADS": threads,
            "MKL_NUM_THREADS": threads,
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])),
        }
        with open(self._log_path, "wb") as log:
            self._proc = subprocess.Popen(
                [
                    mpiexec,
                    "-n",
                    str(size),
                    sys.executable,
                    "-m",
                    "minisarathi.parallel.worker",
                    str(model_dir),
                    resolve_device(device),
                    dtype,
                    address,
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        try:
            self._conn = self._accept(listener)
            _, info = self._receive(STARTUP_TIMEOUT_S, f"while starting (limit {STARTUP_TIMEOUT_S:g}s)")
        finally:
            listener.close()
        self._ranks = info["ranks"]
        self._activation_itemsize = info["activation_itemsize"]

    # ---------------------------------------------------------------- what the engine calls (LlamaModel's
    # names)

    def new_kv_cache(self, num_blocks: int, block_size: int) -> list:
        """Each rank allocates its own KV heads' cache; the engine holds nothing (an empty list)."""
        self._call(("kv_cache", num_blocks, block_size))
        return []

    def copy_blocks(self, kv_cache: list, sources: list[int], destinations: list[int]) -> None:
        """Each rank copies the blocks in its own cache."""
        self._call(("copy_blocks", sources, destinations))

    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        """Per rank: each holds num_key_value_heads / size heads (the budget is per rank, as on one
        device)."""
        c = self._rank_config
        return (
            2
            * c.num_hidden_layers
            * c.num_key_value_heads
            * block_size
            * c.head_dim
            * self._activation_itemsize
        )

    def free_memory_bytes(self) -> int | None:
        free = [r["free_memory_bytes"] for r in self._ranks if r["free_memory_bytes"] is not None]
        return min(free) if free else None

    def rank_info(self) -> list[dict]:
        return [{k: r[k] for k in ("rank", "pid", "host", "device", "weight_bytes")} for r in self._ranks]

    @property
    def weight_format(self) -> str:
        return self._ranks[0]["weight_format"]

    @property
    def weight_bytes(self) -> int:
        return sum(r["weight_bytes"] for r in self._ranks)

    def new_sampler(self, seed: int = 0, eos_token_ids: tuple[int, ...] = ()) -> Sampler:
        return Sampler(self.config.vocab_size, seed, eos_token_ids)  # the logits come back as float32 NumPy

    def forward(self, batch: Batch, kv_cache: list, device_logits: bool = False) -> np.ndarray:
        """float32[N, vocab] logits of batch.logits_indices (on the host whatever device_logits says)."""
        return self._call(("forward", batch))[1]

    def close(self) -> None:
        """Stop the ranks (they also stop by themselves when this process exits: rank 0 sees its socket
        close)."""
        if self._proc.poll() is None and self._failure is None:
            try:
                self._conn.send_bytes(pickle.dumps(("stop",)))
                self._proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self._kill()
        self._conn.close()
        self._dir.cleanup()

    # ---------------------------------------------------------------- plumbing

    def _call(self, command: tuple):
        if self._failure is not None:
            raise self._failure
        try:
            self._conn.send_bytes(pickle.dumps(command))
        except OSError:
            pass  # the group is gone: _receive reports how
        return self._receive(
            self.rank_timeout_s, f"to {command[0]} within rank_timeout_s ({self.rank_timeout_s:g}s)"
        )

    def _accept(self, listener: socket.socket) -> Connection:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            try:
                accepted, _ = listener.accept()
                return Connection(accepted.detach())
            except socket.timeout:
                self._check_alive(deadline, f"while starting (limit {STARTUP_TIMEOUT_S:g}s)")

    def _receive(self, timeout: float, doing: str):
        deadline = time.monotonic() + timeout
        while not self._conn.poll(_POLL_S):
            self._check_alive(deadline, doing)
        try:
            return pickle.loads(self._conn.recv_bytes())
        except (EOFError, OSError):
            try:
                self._proc.wait(timeout=10)  # the socket closed: the group is ending; its status says how
            except subprocess.TimeoutExpired:
                pass
            self._check_alive(deadline, doing)
            raise self._fail("rank 0 closed its connection")

    def _check_alive(self, deadline: float, doing: str) -> None:
        rc = self._proc.poll()
        if rc is not None:
            raise self._fail(f"the rank group exited (mpiexec status {rc})")
        if time.monotonic() > deadline:
            raise self._fail(f"no answer {doing}: a rank hangs")

    def _fail(self, what: str) -> TensorParallelError:
        self._kill()
        report = self._report()
        self._failure = TensorParallelError(
            f"tensor-parallel group of {self.size} ranks failed: {what}; the model is stopped"
            + (f". The ranks' output ends with:\n{report}" if report else "")
        )
        return self._failure

    def _kill(self) -> None:
        if self._proc.poll() is None:
            try:
                os.killpg(self._proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for rank in self._ranks:  # hydra's ranks may have left mpiexec's process group
            try:
                os.kill(rank["pid"], signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self._proc.wait()

    def _report(self, lines: int = 12) -> str:
        try:
            text = Path(self._log_path).read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.strip().splitlines()[-lines:])
