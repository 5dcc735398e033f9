"""How the process is set up for the CPU backend: the BLAS thread count and the allocator's thresholds.

BLAS threads: OpenBLAS starts one thread per CPU, and its threads spin and wait for each other at every
matmul, which collapses on a machine whose CPUs are busy with other processes. So the default ("auto",
None) gives BLAS the CPUs that are idle when the engine starts: the CPUs this process may run on minus the
1-minute load average, at least one. blas_threads=N sets N. Choosing needs threadpoolctl (the `cpu` extra);
without it the BLAS library keeps its own default and the log says so.

BLAS kernels: OpenBLAS picks its kernels for the CPU when it loads, unless OPENBLAS_CORETYPE names a core. An
environment that names an older core than the CPU's (some VMs set Haswell, AVX2, on an AVX-512 CPU) slows
every matmul. The library is loaded by then, so the engine only reads back the core in force and logs it,
with a hint when the environment held back an AVX-512 CPU; it never overrides a user's setting.

Allocator: glibc serves every allocation above 128 KiB with a fresh mmap and gives freed memory back at once,
so each step's large temporaries (a layer's activations, the gathered K/V) are page-faulted in again, step
after step, a large part of a small model's decode step. Keeping allocations up to 32 MiB on the heap and
freed memory in the process (up to 256 MiB) removes those faults; other allocators are left alone.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
from dataclasses import dataclass

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
# what OpenBLAS's AVX-512 ("SkylakeX") kernels need, as its own CPU check (driver/others/dynamic.c) reads them
AVX512_FLAGS = frozenset({"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"})
AVX512_CORES = frozenset({"SkylakeX", "Cooperlake", "SapphireRapids"})  # OpenBLAS's cores that use them
MMAP_THRESHOLD_BYTES = 32 << 20  # the largest glibc accepts on 64-bit
TRIM_THRESHOLD_BYTES = 256 << 20


@dataclass
class CpuSetup:
    blas_threads: int | None  # the BLAS thread count in force; None where no BLAS library could be set
    how: str  # why that count, for the startup log
    allocator_tuned: bool
    blas_kernels: str = "unknown"  # OpenBLAS's core (its kernels) and where it comes from, for the log

    def describe(self) -> str:
        threads = "library default" if self.blas_threads is None else str(self.blas_threads)
        return (
            f"BLAS threads: {threads} ({self.how}); BLAS kernels: {self.blas_kernels}; "
            f"allocator: {'glibc thresholds raised' if self.allocator_tuned else 'unchanged'}"
        )


def available_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def auto_blas_threads() -> tuple[int, str]:
    """The CPUs left idle by other processes (1-minute load average), at least 1."""
    cpus = available_cpus()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    threads = max(1, min(cpus, int(cpus - load + 0.5)))
    return threads, f"auto: {cpus} CPUs, load average {load:.2f}"


def set_blas_threads(threads: int) -> bool:
    """Limit every BLAS library loaded in the process to `threads`; False when threadpoolctl is missing."""
    try:
        from threadpoolctl import ThreadpoolController
    except ImportError:
        return False
    ThreadpoolController().limit(limits=threads, user_api="blas")
    return True


def blas_threads_in_force() -> int | None:
    """The most threads any loaded BLAS library will use now; None where that is unknown (no
    threadpoolctl)."""
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return None
    threads = [i["num_threads"] for i in threadpool_info() if i.get("user_api") == "blas"]
    return max(threads) if threads else None


def cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The first processor's feature flags in a /proc/cpuinfo text."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


@functools.cache
def openblas_core() -> str | None:
    """The core whose kernels the process's OpenBLAS uses (fixed when it loads), e.g. "SkylakeX"; None where
    that is unknown: another BLAS library, or no threadpoolctl to ask."""
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return None
    cores = [i.get("architecture") for i in threadpool_info() if i.get("internal_api") == "openblas"]
    return cores[0] if cores else None


def blas_kernels(cpuinfo_path: str = "/proc/cpuinfo") -> str:
    """The OpenBLAS core in force (threadpoolctl) and where it comes from; a hint when OPENBLAS_CORETYPE keeps
    an AVX-512 CPU on older kernels."""
    try:
        import threadpoolctl  # noqa: F401
    except ImportError:
        return "unknown (threadpoolctl is not installed)"
    core = openblas_core()
    if core is None:
        return "not OpenBLAS"
    forced = os.environ.get("OPENBLAS_CORETYPE")
    if not forced:
        return f"{core} (OpenBLAS's choice for this CPU)"
    try:
        with open(cpuinfo_path, encoding="ascii", errors="replace") as f:
            flags = cpu_flags(f.read(1 << 16))  # the first processor's entry is near the top
    except OSError:
        flags = frozenset()
    hint = (
        "; this CPU has AVX-512: unset it for OpenBLAS's own choice, faster matmuls"
        if core not in AVX512_CORES and AVX512_FLAGS <= flags
        else ""
    )
    return f"{core} (OPENBLAS_CORETYPE={forced} in the environment{hint})"


def tune_allocator() -> bool:
    """Raise glibc's mmap and trim thresholds (see the module docstring); False on other C libraries."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)
    return bool(
        libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
        and libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )


def release_free_memory() -> None:
    """Give the memory glibc keeps free (up to TRIM_THRESHOLD_BYTES, for the next step's temporaries) back to
    the system: for a server that has gone idle, so its RSS is what it holds, not its highest peak so far."""
    if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
        ctypes.CDLL(None).malloc_trim(0)


_kernel_threads = 1  # the native matmuls' thread count; configure_cpu sets it by BLAS's rule
_blas_yielded = False  # whether yield_blas_to_kernels has set BLAS to one thread since configure_cpu


def kernel_threads() -> int:
    """How many threads the native matmuls (quant_linear, half_linear, packed_gemm) run: the count
    configure_cpu chose for BLAS, or 1 before it runs."""
    return _kernel_threads


def yield_blas_to_kernels() -> None:
    """BLAS to one thread where the native matmuls run several: a model whose matrices they multiply
    (quantized, 16-bit) leaves BLAS only attention's products, and OpenBLAS's threads, spinning after each,
    took the cores from the kernels' OpenMP team (a 128-token prefill of a Q4_K_M TinyLlama 1.4x slower on
    2 cores, docs/cpu_performance.md). Called as such a weight is made; configure_cpu undoes it."""
    global _blas_yielded
    if _kernel_threads > 1 and not _blas_yielded:
        _blas_yielded = set_blas_threads(1)


def configure_cpu(blas_threads: int | None) -> CpuSetup:
    """Apply EngineConfig.blas_threads (None: auto) to BLAS and the native matmuls, and the allocator
    thresholds, to this process."""
    global _kernel_threads, _blas_yielded
    _blas_yielded = False
    threads, how = (blas_threads, "set") if blas_threads is not None else auto_blas_threads()
    _kernel_threads = threads
    if not set_blas_threads(threads):
        threads, how = None, "threadpoolctl is not installed: pip install 'minisarathi[cpu]' to choose"
        if blas_threads is not None:
            raise ValueError(
                f"blas_threads ({blas_threads}) needs threadpoolctl: pip install 'minisarathi[cpu]'"
            )
    return CpuSetup(threads, how, tune_allocator(), blas_kernels())
