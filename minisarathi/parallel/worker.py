"""One tensor-parallel rank: `python -m minisarathi.parallel.worker MODEL DEVICE DTYPE ADDRESS`, N of them
started by mpiexec (group.py does it; users never do).

Every rank loads its shard of the weights and runs the same forward pass in lock step, all-reducing twice per
layer. Rank 0 is also the engine's end of the line: it connects to ADDRESS (a Unix socket of the engine's
process), takes each command from there and broadcasts it to the others, and sends back the logits. A rank
that fails aborts the whole group (MPI_Abort), so the engine sees the group end instead of waiting forever.
"""

from __future__ import annotations

import os
import pickle
import socket
import sys
import time
import traceback
from multiprocessing.connection import Client, Connection

import numpy as np

from minisarathi.backends.devices import make_backend, resolve_device
from minisarathi.config import ModelConfig
from minisarathi.model.llama import LlamaModel
from minisarathi.model.loader import load_weights
from minisarathi.parallel.communicator import MpiCommunicator, NcclCommunicator
from minisarathi.parallel.sharding import shard_config, shard_weights

_IDLE_POLL_MAX_S = 0.002  # ranks > 0 wait for the next command by polling, backing off to this


def main(argv: list[str]) -> int:
    model_dir, device, dtype, address = argv
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    try:
        serve(comm, model_dir, resolve_device(device), dtype, address)
    except Exception:
        sys.stderr.write(
            f"tensor-parallel rank {comm.Get_rank()} (pid {os.getpid()}) failed:\n{traceback.format_exc()}"
        )
        sys.stderr.flush()
        comm.Abort(1)
    return 0


def serve(comm, model_dir: str, device: str, dtype: str, address: str) -> None:
    rank, size = comm.Get_rank(), comm.Get_size()
    config = ModelConfig.from_pretrained(model_dir)
    if device == "cuda":
        import cupy

        cupy.cuda.Device(rank % cupy.cuda.runtime.getDeviceCount()).use()
    backend = make_backend(device, config.dtype if dtype == "auto" else dtype, explicit_dtype=dtype != "auto")
    weights = shard_weights(load_weights(model_dir, config), config, rank, size)
    communicator = NcclCommunicator(comm) if device == "cuda" else MpiCommunicator(comm)
    model = LlamaModel(shard_config(config, size), weights, backend, communicator)
    ranks = comm.gather(
        {
            "rank": rank,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "device": device,
            "free_memory_bytes": backend.free_memory_bytes(),
            "weight_bytes": model.weight_bytes,
            "weight_format": model.weight_format,
        },
        root=0,
    )
    engine = None
    if rank == 0:
        engine = Client(address, family="AF_UNIX")
        engine.send_bytes(
            pickle.dumps(
                ("ready", {"ranks": ranks, "activation_itemsize": backend.activation_dtype.itemsize})
            )
        )
    kv_cache = None
    while True:
        command = _next_command(comm, engine)
        if command is None or command[0] == "stop":
            return
        if command[0] == "kv_cache":
            kv_cache = model.new_kv_cache(*command[1:])
            reply = ("ok",)
        elif command[0] == "copy_blocks":
            model.copy_blocks(kv_cache, *command[1:])
            reply = ("ok",)
        else:  # ("forward", batch)
            logits = model.forward(command[1], kv_cache)
            reply = ("logits", logits)
        if engine is not None:
            engine.send_bytes(pickle.dumps(reply))


def _next_command(comm, engine: Connection | None):
    """Rank 0 reads the engine's next command (None when the engine went away) and broadcasts its bytes; the
    other ranks poll for them with a short sleep, since MPICH's blocking calls spin a core while they wait."""
    if engine is not None:
        try:
            payload = engine.recv_bytes()
        except (EOFError, OSError):
            payload = pickle.dumps(None)
        length = np.array([len(payload)], np.int64)
        comm.Ibcast(length, root=0).Wait()  # nonblocking like the other ranks' (the two kinds never match)
        comm.Bcast(np.frombuffer(payload, np.uint8).copy(), root=0)
        return pickle.loads(payload)
    length = np.zeros(1, np.int64)
    request = comm.Ibcast(length, root=0)
    delay = 1e-5
    while not request.Test():
        time.sleep(delay)
        delay = min(2 * delay, _IDLE_POLL_MAX_S)
    payload = np.empty(int(length[0]), np.uint8)
    comm.Bcast(payload, root=0)
    return pickle.loads(payload.tobytes())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
