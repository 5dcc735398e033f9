"""The GPU the emulator stands in for: the per-block and per-SM limits a launch on it must respect.

The limits are CUDA's device attributes (CUDA C++ Programming Guide, "Technical Specifications per Compute
Capability"); resident_blocks() is the occupancy rule that a cooperative launch is checked against, as
cuLaunchCooperativeKernel checks it (cudaOccupancyMaxActiveBlocksPerMultiprocessor x SMs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Device:
    name: str
    arch: str  # the NVRTC -arch the kernels are compiled for (their static resources)
    multiprocessors: int
    shared_memory_per_block_optin: int  # sharedMemPerBlockOptin: static + dynamic of one block, at most
    shared_memory_per_sm: int  # sharedMemPerMultiprocessor (the largest carveout)
    reserved_shared_memory_per_block: int = (
        1024  # reservedSharedMemPerBlock: the system's, per resident block
    )
    shared_memory_granularity: int = 128  # a block's shared memory is allocated in these units
    max_threads_per_sm: int = 2048
    max_blocks_per_sm: int = 32
    registers_per_sm: int = 65536  # in 4 sub-partitions; a warp's registers come in units of 256
    shared_memory_without_optin: int = 48 * 1024  # static + dynamic a block gets without cuFuncSetAttribute

    def resident_blocks(self, threads: int, shared_bytes: int, registers: int | None) -> int:
        """Blocks of `threads` threads with `shared_bytes` (static + dynamic) of shared memory and `registers`
        per thread (None: unknown, not counted) that one SM holds at once."""
        warps = math.ceil(threads / 32)
        per_block = (
            math.ceil((shared_bytes + self.reserved_shared_memory_per_block) / self.shared_memory_granularity)
            * self.shared_memory_granularity
        )
        limits = [
            self.max_blocks_per_sm,
            self.max_threads_per_sm // (32 * warps),
            self.shared_memory_per_sm // per_block,
        ]
        if registers:
            warp_registers = math.ceil(registers * 32 / 256) * 256
            limits.append(4 * (self.registers_per_sm // 4 // warp_registers) // warps)
        return min(limits)


# H100 / H200 SXM (sm_90): 227 KiB opt-in per block, 228 KiB per SM.
H100 = Device("H100/H200 (sm_90)", "sm_90", 132, 232448, 233472)
# A100 (sm_80): 163 KiB opt-in per block, 164 KiB per SM.
A100 = Device("A100 (sm_80)", "sm_80", 108, 166912, 167936)
