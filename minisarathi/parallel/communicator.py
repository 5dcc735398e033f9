"""The one collective the sharded model needs: a sum over ranks (all-reduce), behind one small interface.

MpiCommunicator reduces NumPy arrays over MPI (mpi4py with MPICH from PyPI); NcclCommunicator reduces CuPy
arrays with NCCL (cupy.cuda.nccl) and uses MPI only to hand NCCL's unique id to every rank.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np


class Communicator(Protocol):
    rank: int
    world_size: int

    def all_reduce(self, x: Any) -> Any:
        """x summed elementwise over the ranks, in place on every rank (x is returned)."""


class MpiCommunicator:
    def __init__(self, comm):
        """comm: an mpi4py intracommunicator (COMM_WORLD of the ranks)."""
        from mpi4py import MPI

        self._comm = comm
        self._sum = MPI.SUM
        self._in_place = MPI.IN_PLACE
        self.rank = comm.Get_rank()
        self.world_size = comm.Get_size()

    def all_reduce(self, x: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x)
        self._comm.Allreduce(self._in_place, x, op=self._sum)
        return x


class NcclCommunicator:
    """Not yet run over two GPUs (this project's GPU machine has one): bench/gpu_check.py's nccl section runs
    tensor parallelism over it where two are present; the tests check it on one GPU (a one-rank all-reduce)
    where NCCL is installed, and its interface against MpiCommunicator's everywhere."""

    def __init__(self, comm):
        from cupy.cuda import nccl

        if not nccl.available:
            raise RuntimeError(
                "tensor parallelism on GPUs needs NCCL: pip install 'nvidia-nccl-cu13' (or -cu12)"
            )
        self._nccl = nccl
        self.rank = comm.Get_rank()
        self.world_size = comm.Get_size()
        unique_id = comm.bcast(nccl.get_unique_id() if self.rank == 0 else None, root=0)
        self._comm = nccl.NcclCommunicator(self.world_size, unique_id, self.rank)
        # activation dtype -> NCCL type; bfloat16 activations are held as uint16 bits
        self.nccl_types = {
            np.dtype(np.float32): nccl.NCCL_FLOAT32,
            np.dtype(np.float16): nccl.NCCL_FLOAT16,
            np.dtype(np.uint16): nccl.NCCL_BFLOAT16,
        }

    def all_reduce(self, x):
        import cupy

        x = cupy.ascontiguousarray(x)
        self._comm.allReduce(
            x.data.ptr,
            x.data.ptr,
            x.size,
            self.nccl_types[x.dtype],
            self._nccl.NCCL_SUM,
            cupy.cuda.get_current_stream().ptr,
        )
        return x
