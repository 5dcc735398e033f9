"""Loads an emulator build with ctypes and launches its kernels with CuPy's RawKernel calling convention."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import threading
from pathlib import Path

import numpy as np

from minisarathi.backends.emulator.builder import build
from minisarathi.backends.emulator.cubin import KernelResources, kernel_resources
from minisarathi.backends.emulator.device import H100, Device

ORDERS = ("forward", "reverse", "random")
NVRTC_OPTIONS = ("-std=c++17",)  # what a RawModule gets besides CuPy's own (cuda_ops.NVRTC_OPTIONS)

# C++ element type -> NumPy dtype names accepted for a pointer to it. NumPy has no bfloat16: its arrays
# hold the raw bits as uint16 (or ml_dtypes.bfloat16 where installed).
POINTER_DTYPES = {
    "float": ("float32",),
    "double": ("float64",),
    "__half": ("float16",),
    "__nv_bfloat16": ("uint16", "bfloat16"),
    "int": ("int32",),
    "unsigned int": ("uint32",),
    "long long": ("int64",),
    "unsigned long long": ("uint64",),
    "long": ("int64",),
    "unsigned long": ("uint64",),
    "short": ("int16",),
    "unsigned short": ("uint16",),
    "char": ("int8",),
    "signed char": ("int8",),
    "unsigned char": ("uint8",),
    "bool": ("bool",),
}
SCALAR_DTYPES = {
    "float": np.float32,
    "double": np.float64,
    "int": np.int32,
    "unsigned int": np.uint32,
    "long long": np.int64,
    "unsigned long long": np.uint64,
    "long": np.int64,
    "unsigned long": np.uint64,
    "short": np.int16,
    "unsigned short": np.uint16,
    "char": np.int8,
    "signed char": np.int8,
    "unsigned char": np.uint8,
    "bool": np.bool_,
}


class _LaunchArgs(ctypes.Structure):  # mirrors emu::LaunchArgs
    _fields_ = [
        ("grid", ctypes.c_uint * 3),
        ("block", ctypes.c_uint * 3),
        ("dynamic_smem", ctypes.c_ulonglong),
        ("order", ctypes.c_int),
        ("num_threads", ctypes.c_int),
        ("seed", ctypes.c_ulonglong),
        ("cooperative", ctypes.c_int),
    ]


class CUDADriverError(RuntimeError):
    """What CuPy raises when the driver refuses (cupy_backends.cuda.api.driver.CUDADriverError), e.g.
    `CUDA_ERROR_INVALID_VALUE: invalid argument` for a launch over its shared memory limit."""


_schedule = threading.local()
_capture = threading.local()  # .launches: the list a capture records into; absent or None when not capturing
_side = threading.local()  # .launches: side-stream work not yet joined; .open: issuing to the side stream


class Graph:
    """The emulator's CUDA graph: the launches recorded by capture(), run again in order with the arguments
    they were recorded with. Like a real graph's kernels, a replayed launch reads whatever its arrays hold
    now: an input the step did not write into one of them is read stale, as it would be on a GPU."""

    def __init__(self, launches: list):
        self.launches = launches

    def launch(self) -> None:
        for run in self.launches:
            run()


def capture(fn):
    """(Graph, fn()): fn's launches recorded, not run, as CUDA stream capture records them. What fn returns
    is computed only by a replay. Host-to-device copies are refused meanwhile (capturing(); CUDA forbids
    synchronous copies during a capture)."""
    if capturing():
        raise RuntimeError("capture: already capturing")
    _capture.launches = []
    try:
        result = fn()
        return Graph(_capture.launches), result
    finally:
        _capture.launches = None


def capturing() -> bool:
    return getattr(_capture, "launches", None) is not None


@contextlib.contextmanager
def side_stream():
    """Launches issued inside go to a second stream, which starts after what was issued before. Here they are
    held and run only at join_side_stream(): a result read before the join (a missing event wait on a GPU,
    where it would be a race) reads what its array held before."""
    if capturing():
        raise RuntimeError("side_stream: not inside a capture (a graph's work stays on one stream here)")
    if getattr(_side, "launches", None) is not None:
        raise RuntimeError("side_stream: the previous side stream's work was never joined (join_side_stream)")
    _side.launches, _side.open = [], True
    try:
        yield
    except BaseException:
        _side.launches = None  # the step failed: its side work is dropped with it
        raise
    finally:
        _side.open = False


def join_side_stream() -> None:
    """The current stream waits for the side stream's work: here, that work runs now."""
    launches, _side.launches = getattr(_side, "launches", None), None
    if launches is None:
        raise RuntimeError("join_side_stream: no side stream's work to join")
    for run in launches:
        run()


def submit(run) -> None:
    """Runs a launch now, or records it while capturing, or holds it while issuing to the side stream."""
    if capturing():
        _capture.launches.append(run)
    elif getattr(_side, "open", False):
        _side.launches.append(run)
    else:
        run()


def _env_schedule() -> tuple[str, int]:
    order = os.environ.get("MINISARATHI_EMU_ORDER", "forward")
    if order not in ORDERS:
        raise ValueError(f"MINISARATHI_EMU_ORDER must be one of {', '.join(ORDERS)}, got {order!r}")
    return order, int(os.environ.get("MINISARATHI_EMU_SEED", "0"))


@contextlib.contextmanager
def schedule(order: str, seed: int = 0):
    """Runs the launches inside the block with this fiber order (forward, reverse, or random per seed)."""
    if order not in ORDERS:
        raise ValueError(f"order must be one of {', '.join(ORDERS)}, got {order!r}")
    previous = getattr(_schedule, "value", None)
    _schedule.value = (order, int(seed))
    try:
        yield
    finally:
        _schedule.value = previous


def _dim3(value, name: str) -> tuple[int, int, int]:
    dims = (value,) if isinstance(value, (int, np.integer)) else tuple(value)
    if not 1 <= len(dims) <= 3 or any(
        isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 1 for d in dims
    ):
        raise ValueError(f"{name} must be 1 to 3 positive integers, got {value!r}")
    return tuple(int(d) for d in dims) + (1,) * (3 - len(dims))


def _convert(index: int, param: str, value, keep: list) -> int:
    """Returns the address of a buffer that holds `value` exactly as the kernel's parameter type."""
    where = f"argument {index} ({param})"
    if param.endswith("*"):
        element = param[:-1].removeprefix("const ").strip()
        if not isinstance(value, np.ndarray):
            raise TypeError(f"{where}: expected a NumPy array, got {type(value).__name__}")
        if value.dtype.name not in POINTER_DTYPES.get(element, ()):
            raise TypeError(
                f"{where}: expected dtype {' or '.join(POINTER_DTYPES.get(element, ('?',)))}, "
                f"got {value.dtype}"
            )
        if not param.startswith("const ") and not value.flags.writeable:
            raise TypeError(f"{where}: the kernel writes through this pointer but the array is read-only")
        pointer = ctypes.c_void_p(value.ctypes.data)
        keep += [value, pointer]
        return ctypes.addressof(pointer)
    dtype = SCALAR_DTYPES.get(param)
    if dtype is None:
        raise TypeError(f"{where}: parameter type not supported by the emulator")
    if not isinstance(value, np.generic) or value.dtype != np.dtype(dtype):
        # CuPy passes a Python float as double and a Python int as long long: wrong bytes for a
        # float or int parameter on a real GPU. Demand the exact type so the bug shows here.
        raise TypeError(
            f"{where}: pass numpy.{np.dtype(dtype).name}(...), got {type(value).__name__} "
            f"{value!r} (on a GPU, CuPy would pass it with the wrong width)"
        )
    buffer = np.array(value, dtype=dtype)
    keep.append(buffer)
    return buffer.ctypes.data


class EmulatedKernel:
    """One kernel of an emulated module; called like cupy.RawKernel: kernel(grid, block, args, shared_mem=0).
    It refuses what the driver refuses on `device`: more dynamic shared memory than
    max_dynamic_shared_size_bytes allows (by default 48 KiB minus the kernel's static shared memory), that
    attribute set above the device's opt-in maximum minus the static memory, more threads than
    __launch_bounds__, and, launched cooperatively (a module loaded with enable_cooperative_groups), a grid
    larger than the device holds at once."""

    def __init__(
        self,
        library: ctypes.CDLL,
        index: int,
        name: str,
        resources: KernelResources,
        device: Device,
        cooperative: bool,
    ):
        self.name = name
        self.resources = resources
        self.device = device
        self.cooperative = cooperative
        self._max_dynamic_shared = device.shared_memory_without_optin - resources.static_shared_bytes
        self._launch = getattr(library, f"minisarathi_emu_launch_{index}")
        self._launch.restype = ctypes.c_int
        self._launch.argtypes = [ctypes.POINTER(_LaunchArgs), ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int]
        signature = getattr(library, f"minisarathi_emu_signature_{index}")
        signature.restype = ctypes.c_char_p
        self.param_types = [p for p in signature().decode().split(";") if p]

    @property
    def max_dynamic_shared_size_bytes(self) -> int:
        return self._max_dynamic_shared

    @max_dynamic_shared_size_bytes.setter
    def max_dynamic_shared_size_bytes(self, nbytes: int) -> None:
        # cuFuncSetAttribute(CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES): static + dynamic within the
        # opt-in.
        most = self.device.shared_memory_per_block_optin - self.resources.static_shared_bytes
        if not 0 <= nbytes <= most:
            raise CUDADriverError(
                f"CUDA_ERROR_INVALID_VALUE: invalid argument (max_dynamic_shared_size_bytes = {nbytes} for "
                f"{self.name}: at most {most}, the {self.device.name}'s "
                f"{self.device.shared_memory_per_block_optin} bytes per block "
                f"minus {self.resources.static_shared_bytes} of static shared memory)"
            )
        self._max_dynamic_shared = int(nbytes)

    @property
    def attributes(self) -> dict[str, int]:
        """The keys of CuPy's RawKernel.attributes that the emulator knows (num_regs -1 when unknown)."""
        return {
            "shared_size_bytes": self.resources.static_shared_bytes,
            "max_dynamic_shared_size_bytes": self._max_dynamic_shared,
            "max_threads_per_block": self.resources.max_threads_per_block,
            "num_regs": self.resources.registers or -1,
        }

    def __call__(self, grid, block, args, shared_mem: int = 0):
        grid, block = _dim3(grid, "grid"), _dim3(block, "block")
        threads = block[0] * block[1] * block[2]
        if threads > self.resources.max_threads_per_block:
            raise CUDADriverError(
                f"CUDA_ERROR_INVALID_VALUE: invalid argument ({self.name}: block {block} has "
                f"{threads} threads, its limit is {self.resources.max_threads_per_block})"
            )
        if not 0 <= shared_mem <= self._max_dynamic_shared:
            static = self.resources.static_shared_bytes
            raise CUDADriverError(
                f"CUDA_ERROR_INVALID_VALUE: invalid argument ({self.name}: {shared_mem} bytes of dynamic "
                "shared "
                f"memory + {static} static, but max_dynamic_shared_size_bytes is {self._max_dynamic_shared}; "
                f"above {self.device.shared_memory_without_optin} bytes in all a kernel must opt in, as on "
                "a GPU)"
            )
        if self.cooperative:
            self._check_co_resident(grid, threads, shared_mem)
        args = tuple(args)
        if len(args) != len(self.param_types):
            raise TypeError(
                f"{self.name} takes {len(self.param_types)} arguments "
                f"({', '.join(self.param_types)}), got {len(args)}"
            )
        keep: list = []  # the arguments' buffers: alive as long as the launch, or the graph that records it
        addresses = (ctypes.c_void_p * max(1, len(args)))(
            *[_convert(i, p, a, keep) for i, (p, a) in enumerate(zip(self.param_types, args))]
        )
        submit(functools.partial(self._run, grid, block, shared_mem, addresses, keep))

    def _check_co_resident(self, grid, threads: int, shared_mem: int) -> None:
        """cuLaunchCooperativeKernel's rule: every block resident at once. CuPy would shrink a 1-D grid over
        the limit (with a warning) and launch that, which leaves a kernel whose blocks wait for each other
        waiting."""
        per_sm = self.device.resident_blocks(
            threads, self.resources.static_shared_bytes + shared_mem, self.resources.registers
        )
        limit = per_sm * self.device.multiprocessors
        if grid[0] * grid[1] * grid[2] > limit:
            raise ValueError(
                f"{self.name}: a cooperative launch of grid {grid} is more than the {limit} blocks the "
                f"{self.device.name} holds at once ({per_sm} per SM x {self.device.multiprocessors} SMs for "
                f"{threads} threads, {self.resources.static_shared_bytes} + {shared_mem} bytes of shared "
                "memory "
                f"and {self.resources.registers or 'unknown'} registers a thread)"
            )

    def _run(self, grid, block, shared_mem: int, addresses, keep: list) -> None:
        order, seed = getattr(_schedule, "value", None) or _env_schedule()  # the order when it runs
        config = _LaunchArgs(
            (ctypes.c_uint * 3)(*grid),
            (ctypes.c_uint * 3)(*block),
            shared_mem,
            ORDERS.index(order),
            int(os.environ.get("MINISARATHI_EMU_THREADS", os.cpu_count() or 1)),
            seed,
            int(self.cooperative),
        )
        error = ctypes.create_string_buffer(4096)
        # ctypes releases the GIL for the call, so other Python threads run while the kernel does.
        if self._launch(ctypes.byref(config), addresses, error, len(error)) != 0:
            raise RuntimeError(f"{self.name}: {error.value.decode(errors='replace')}")


class EmulatedModule:
    """The emulator's cupy.RawModule: one .cu file built with g++, kernels looked up by name expression. As
    with RawModule(enable_cooperative_groups=True), a cooperative module launches every kernel cooperatively.
    `device` sets the limits launches are checked against (emulator.H100, sm_90, by default; emulator.A100:
    sm_80)."""

    def __init__(
        self,
        source: str | Path,
        name_expressions: list[str],
        include_dirs: list[str | Path] = (),
        enable_cooperative_groups: bool = False,
        device: Device = H100,
    ):
        self.path = build(source, list(name_expressions), include_dirs)
        resources = kernel_resources(
            Path(source).resolve(),
            list(name_expressions),
            [Path(d).resolve() for d in include_dirs],
            NVRTC_OPTIONS,
            device.arch,
        )
        self._library = ctypes.CDLL(str(self.path))
        self._kernels = {
            name: EmulatedKernel(self._library, i, name, resources[name], device, enable_cooperative_groups)
            for i, name in enumerate(name_expressions)
        }

    def get_function(self, name: str) -> EmulatedKernel:
        if name not in self._kernels:
            raise ValueError(
                f"name: {name!r} is not among this module's name expressions ({', '.join(self._kernels)})"
            )
        return self._kernels[name]


_modules: dict[tuple, EmulatedModule] = {}
_modules_lock = threading.Lock()


def load_module(
    source: str | Path,
    name_expressions: list[str],
    include_dirs: list[str | Path] = (),
    enable_cooperative_groups: bool = False,
    device: Device = H100,
) -> EmulatedModule:
    """Builds (or reuses) and loads the module once per process, options and device."""
    key = (
        str(Path(source).resolve()),
        tuple(name_expressions),
        tuple(str(d) for d in include_dirs),
        enable_cooperative_groups,
        device,
    )
    with _modules_lock:
        if key not in _modules:
            _modules[key] = EmulatedModule(
                source, list(name_expressions), include_dirs, enable_cooperative_groups, device
            )
        return _modules[key]
