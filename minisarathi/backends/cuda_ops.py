"""The CUDA backend: the ops of docs/architecture.md as the kernels of cuda/*.cu, matmuls through cuBLAS.

The wrappers are written once against a launcher that says where kernels run:
  - CupyLauncher: a real GPU. Kernels are CuPy RawModules compiled once per process with NVRTC, arrays
    are CuPy arrays, matmuls cublasGemmEx on a handle of our own (cublas.py: CuPy's own refuses to be
    captured). CuPy is imported only here (cupy-cuda12x or cupy-cuda13x).
  - EmulatorLauncher: the same .cu sources built with g++ and run on the CPU (device "cuda-emulated");
    arrays are NumPy, matmuls the same cuBLAS calls over the emulator's libcublas (emulator/cublas.py).
Both launch with CuPy's RawKernel convention `kernel(grid, block, args, shared_mem=n)`, with scalars
passed as exact NumPy types (np.int32, np.float32, np.int64), which the emulator checks.

bfloat16 has no NumPy (or CuPy) dtype: such arrays hold the raw bits as uint16 (minisarathi/dtypes.py).

    ops = cuda_ops.emulated()              # float32 kernels on the CPU
    ops = cuda_ops.gpu("bfloat16")         # a real GPU
    model = LlamaModel(config, weights, ops)
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import re
from dataclasses import dataclass

import numpy as np

from minisarathi.backends import cublas, decode_plan, emulator
from minisarathi.backends.emulator import cublas as emulated_cublas
from minisarathi.backends.gpu_sampling import GpuSampler, sample_rows
from minisarathi.backends.kernel_source import kernel_constants
from minisarathi.backends.pinned_staging import PinnedStaging
from minisarathi.batch import Batch
from minisarathi.dtypes import DTYPES, STORAGE_DTYPES, convert, dtype_name, to_float32
from minisarathi.model.loader import CheckpointTensor
from minisarathi.paths import cuda_dir
from minisarathi.quant.layouts import Fp8Rows, IntGroups, Stacked, UintGroups

log = logging.getLogger("minisarathi.cuda")

CXX_TYPES = {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16"}

# Kernel files and their kernels: templated ones are instantiated for every element type.
TEMPLATED_KERNELS = {
    "embedding.cu": ["embedding_kernel"],
    "rms_norm.cu": ["rms_norm_kernel", "add_rms_norm_kernel"],
    "rope_store_kv.cu": ["rope_store_kv_kernel"],
    "paged_attention.cu": ["paged_attention_kernel", "paged_attention_reduce_kernel"],
    "decode_attention.cu": ["decode_attention_reduce_kernel"],
    "silu_and_mul.cu": ["silu_and_mul_kernel"],
    "gemma.cu": ["gelu_tanh_and_mul_kernel", "softcap_kernel"],
    "copy_blocks.cu": ["copy_blocks_kernel"],
}
PLAIN_KERNELS = {
    "sampling.cu": ["argmax_kernel", "apply_penalties_kernel", "sample_kernel"],
    "token_bitmask.cu": ["apply_token_bitmask_kernel"],
}
# Kernels whose CTAs wait for each other (sample_kernel's split rows): launched cooperatively, so that a
# grid the device cannot hold at once fails to launch instead of hanging.
COOPERATIVE_KERNELS = {"sample_kernel"}
# Tensor-core kernels: 16-bit types only, one instantiation per head_dim.
PREFILL_HEAD_DIMS = (16, 64, 80, 96, 128)
TENSOR_CORE_KERNELS = {
    "prefill_attention.cu": [
        f"prefill_attention_kernel<{t}, {d}>" for t in ("__half", "__nv_bfloat16") for d in PREFILL_HEAD_DIMS
    ]
}
# Quantized-weight linears (16-bit activations): element type x weight format x row tile.
QL = kernel_constants("quant_linear.cu")  # QL_THREADS, QL_BN, QL_BK, QL_INT8, QL_UINT4, QL_FP8, ...
QUANT_TYPES = ("__half", "__nv_bfloat16")
QUANT_FORMATS = (QL["QL_INT8"], QL["QL_UINT4"], QL["QL_FP8"])
QUANT_KERNELS = {
    "quant_linear.cu": [
        f"quant_linear_kernel<{t}, {q}, {bm}>"
        for t in QUANT_TYPES
        for q in QUANT_FORMATS
        for bm in (QL["QL_DECODE_ROWS"], QL["QL_PREFILL_ROWS"])
    ]
    + [f"quant_embedding_kernel<{t}, {q}>" for t in QUANT_TYPES for q in QUANT_FORMATS]
    + [f"quant_linear_reduce_kernel<{t}>" for t in QUANT_TYPES]
}
QUANT_CTAS_PER_SM = 4  # quant_linear CTAs per SM a split grid aims at (4 stages x 2-4 KiB in flight each)
QUANT_MIN_SPLIT_TILES = 4  # k tiles per split at least: shorter splits spend more on partials than they gain
# Kernels with compile-time tiles besides the element type: file -> instantiations.
TILED_KERNELS = {
    "decode_attention.cu": [
        f"decode_attention_kernel<{CXX_TYPES[d]}, {g}, {lanes}>" for d, g, lanes in decode_plan.INSTANTIATIONS
    ]
}

# Options for NVRTC at run time; CuPy adds the architecture and its own include path.
NVRTC_OPTIONS = ("-std=c++17",)

PA_PARTITION_SIZE = 512  # keys per flash-decoding partition (the host's choice, passed to the kernel)
SMEM_BUDGET = 48 * 1024  # dynamic shared memory a kernel gets without opting in
GRID_STRIDE_BLOCKS = 1024  # grid of the grid-stride kernels: about 8 blocks per SM on an H100/H200
VECTOR_BYTES = 16  # the kernels' vector loads (cuda/vec.cuh) need this alignment


PA = kernel_constants("paged_attention.cu")  # PA_THREADS, PA_MAX_ROWS, PA_MAX_HEAD_DIM, ...
PF = kernel_constants(
    "prefill_attention.cu"
)  # PF_THREADS, PF_ROWS (rows per CTA), PF_KEYS (keys per tile), PF_PAD, ...
PF_WAVES = 2  # waves of CTAs a split prefill grid aims at
PF_MIN_FILL = 0.85  # an unsplit grid whose last wave is at least this full is left alone
PF_MIN_SPLIT_KEYS = 512  # keys per split at least: fewer would spend more on partials than they win


def name_expressions(file: str) -> list[str]:
    """Every kernel of a file as NVRTC names it: `rms_norm_kernel<__half>`, `decode_attention_kernel<float, 4,
    16>`, `argmax_kernel`."""
    if file in TEMPLATED_KERNELS:
        return TILED_KERNELS.get(file, []) + [
            f"{k}<{t}>" for k in TEMPLATED_KERNELS[file] for t in CXX_TYPES.values()
        ]
    if file in TENSOR_CORE_KERNELS:
        return list(TENSOR_CORE_KERNELS[file])
    if file in QUANT_KERNELS:
        return list(QUANT_KERNELS[file])
    return list(PLAIN_KERNELS[file])


def nvrtc_options(file: str) -> tuple[str, ...]:
    """NVRTC's options for cuda/<file>. CuPy keys its kernel cache by the source text and the options only,
    not by the headers the source includes: a digest of those (followed transitively) goes into the options,
    so an edited header compiles anew instead of loading a stale cubin."""
    digest, seen, pending = hashlib.sha256(), set(), [file]
    while pending:
        name = pending.pop()
        text = (cuda_dir() / name).read_text()
        if name != file:
            digest.update(name.encode() + b"\0" + text.encode())
        for header in re.findall(r'^\s*#\s*include\s+"([^"]+)"', text, re.MULTILINE):
            if header not in seen:
                seen.add(header)
                pending.append(header)
    return (*NVRTC_OPTIONS, f"-I{cuda_dir()}", f"-DMINISARATHI_HEADERS_SHA256={digest.hexdigest()[:16]}")


def kernel_files() -> list[str]:
    return [*TEMPLATED_KERNELS, *TENSOR_CORE_KERNELS, *QUANT_KERNELS, *PLAIN_KERNELS]


class EmulatorLauncher:
    """Kernels on the CPU through minisarathi.backends.emulator; arrays are NumPy."""

    device = "cuda-emulated"
    xp = np
    # Grids are sized for the GPU the emulator stands in for (an H100/H200), so emulated runs launch what it
    # runs.
    multiprocessors = 132

    def __init__(self):
        # The GPU's cuBLAS calls, over the emulator's libcublas; its workspace is host memory.
        self._workspace = np.empty(cublas.WORKSPACE_BYTES, np.uint8)  # uint8[WORKSPACE_BYTES], never touched
        self._gemm = cublas.CublasGemm(
            emulated_cublas.EmulatedCublas(), self._workspace.ctypes.data, cublas.WORKSPACE_BYTES
        )
        self._captured_arrays: list | None = None  # while capturing: what the graph's GEMMs address

    def kernel(self, file: str, name: str):
        return emulator.load_module(
            cuda_dir() / file, name_expressions(file), enable_cooperative_groups=name in COOPERATIVE_KERNELS
        ).get_function(name)

    def to_device(self, array: np.ndarray) -> np.ndarray:
        _refuse_copy_while_capturing("host-to-device")
        return np.array(array, order="C")  # a copy, as an upload is: device arrays never alias host ones

    def copy_to_device(self, device: np.ndarray, array: np.ndarray) -> None:
        _refuse_copy_while_capturing("host-to-device")
        device[...] = array

    def to_host(self, array: np.ndarray) -> np.ndarray:
        _refuse_copy_while_capturing("device-to-host")
        return array

    def to_host_async(self, arrays: list[np.ndarray]):
        """CupyLauncher.to_host_async: here the kernels have run already, so the arrays are ready."""
        _refuse_copy_while_capturing("device-to-host")
        return lambda: list(arrays)

    def matmul_t(self, x: np.ndarray, w: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
        """CupyLauncher.matmul_t's calls, run by the emulator's cuBLAS (recorded while capturing)."""
        x, w = np.ascontiguousarray(x), np.ascontiguousarray(w)
        out = np.empty((x.shape[0], w.shape[0]), dtype=x.dtype)  # [T, N]
        if bias is not None:
            emulator.submit(lambda: np.copyto(out, bias))  # CuPy's copy kernel, captured with the GEMM
        self._gemm.matmul_t(x, w, out, dtype_name(x), bias is not None, emulated_cublas.current_stream())
        if self._captured_arrays is not None:  # the graph keeps what its GEMM reads and writes
            self._captured_arrays += [x, w, out]
        return out

    def side_stream(self):
        """CupyLauncher.side_stream: the launches inside are held until join_side_stream()
        (emulator.side_stream)."""
        return emulator.side_stream()

    def join_side_stream(self) -> None:
        emulator.join_side_stream()

    def free_graph_memory(self) -> None:
        """CupyLauncher.free_graph_memory: the emulator's graphs hold host arrays, freed with the graphs."""

    def capture(self, fn):
        """(graph, fn()): fn's launches recorded as a graph (emulator.capture); graph.launch() replays them.
        The graph holds the arrays its GEMMs address by pointer, as a graph's memory pool does on a GPU."""
        self._captured_arrays = []
        try:
            graph, result = emulator.capture(fn)
            graph.arrays = self._captured_arrays
            return graph, result
        finally:
            self._captured_arrays = None


class CupyLauncher:
    """Kernels on a real GPU: CuPy RawModules (NVRTC), compiled once per process; cuBLAS matmuls."""

    device = "cuda"

    def __init__(self):
        try:
            import cupy
        except ImportError as exc:
            raise RuntimeError(
                "device 'cuda' needs CuPy: pip install 'minisarathi[cuda12]' or '[cuda13]'"
            ) from exc
        self.xp = cupy
        self.multiprocessors = cupy.cuda.Device().attributes["MultiProcessorCount"]
        self._modules: dict[str, object] = {}
        self._kernels: dict[tuple[str, str], object] = {}
        self._graph_pool = self._capture_stream = None  # made at the first capture
        self._gemm = self._workspace = None  # made at the first matmul
        self._staging = PinnedStaging(cupy)
        self._side = self._forked = self._side_done = None  # side_stream(): made at its first use

    def kernel(self, file: str, name: str):
        kernel = self._kernels.get((file, name))
        if kernel is None:
            # CuPy launches every kernel of a cooperative module cooperatively, and cuts a 1-D grid that is
            # not co-resident to what is (a warning only): only the kernels whose CTAs wait for each other get
            # one.
            cooperative = name in COOPERATIVE_KERNELS
            module = self._modules.get((file, cooperative))
            if module is None:
                source = (cuda_dir() / file).read_text()
                module = self.xp.RawModule(
                    code=source,
                    options=nvrtc_options(file),
                    name_expressions=name_expressions(file),
                    enable_cooperative_groups=cooperative,
                )
                self._modules[(file, cooperative)] = module
            kernel = self._kernels[(file, name)] = module.get_function(name)
        return kernel

    def to_device(self, array: np.ndarray):
        out = self.xp.empty(array.shape, dtype=array.dtype)
        self._staging.copy(
            out, array
        )  # a step's arrays through pinned memory; weights straight from where they are
        return out

    def copy_to_device(self, device, array: np.ndarray) -> None:
        self._staging.copy(device, array)  # on the current stream, ordered before the launches after it

    @contextlib.contextmanager
    def side_stream(self):
        """Launches inside go to a second stream, after everything issued on the current one so far (an
        event); join_side_stream() makes the current stream wait for them. What is allocated inside comes from
        the side stream's share of CuPy's pool, so its memory is reused only in that stream's order."""
        cp = self.xp
        if self._side is None:
            self._side = cp.cuda.Stream(non_blocking=True)
            self._forked, self._side_done = (
                cp.cuda.Event(disable_timing=True),
                cp.cuda.Event(disable_timing=True),
            )
        self._forked.record()
        self._side.wait_event(self._forked)
        try:
            with self._side:
                yield
        finally:
            self._side_done.record(self._side)

    def join_side_stream(self) -> None:
        self.xp.cuda.get_current_stream().wait_event(self._side_done)

    def capture(self, fn):
        """(graph, fn()): fn's launches captured as a CUDA graph; graph.launch() replays them on the current
        stream. The capture runs on a side stream (the legacy default stream cannot be captured), and what fn
        allocates comes from a memory pool only graphs use: CuPy's pool would otherwise hand the memory of
        fn's intermediates, freed when fn returns, to other code, which each replay would then overwrite.
        Graphs share that pool: they replay one at a time on one stream, and fn's result (the graph's output,
        kept by the caller) stays allocated."""
        cupy = self.xp
        if self._graph_pool is None:
            self._graph_pool, self._capture_stream = (
                cupy.cuda.MemoryPool(),
                cupy.cuda.Stream(non_blocking=True),
            )
        stream = self._capture_stream
        with cupy.cuda.using_allocator(self._graph_pool.malloc), stream:
            stream.begin_capture()
            try:
                result = fn()
            except BaseException:
                try:
                    stream.end_capture()  # ends the capture; fn's error is the one to report
                except Exception:
                    pass
                raise
            graph = stream.end_capture()
        return graph, result

    def free_graph_memory(self) -> None:
        """Hands the memory the graphs' pool keeps cached back to the device, once no graph is kept."""
        if self._graph_pool is not None:
            self._graph_pool.free_all_blocks()

    def to_host(self, array) -> np.ndarray:
        return self.xp.asnumpy(array)

    def to_host_async(self, arrays: list):
        """Starts copying `arrays` into pinned host memory behind the work queued so far; returns a function
        that waits for that copy (an event, not the stream: work queued later, such as the next step's
        forward, keeps running) and returns the host arrays. to_host() would wait for everything queued."""
        cp = self.xp
        copies = []
        for array in arrays:
            array = cp.ascontiguousarray(array)
            pinned = cp.cuda.alloc_pinned_memory(max(array.nbytes, 1))
            host = np.frombuffer(pinned, array.dtype, array.size).reshape(array.shape)  # keeps `pinned` alive
            array.get(out=host, blocking=False)
            copies.append(host)
        copied = cp.cuda.Event(disable_timing=True)
        copied.record()

        def wait() -> list[np.ndarray]:
            copied.synchronize()
            return copies

        return wait

    def matmul_t(self, x, w, bias):
        """x[T, K] @ w[N, K].T (+ bias) through cuBLAS on this launcher's own handle (minisarathi/backends/
        cublas.py: CuPy's `@` refuses a capturing stream), accumulated in float32, rounded once to x's
        type."""
        cp = self.xp
        if self._gemm is None:  # at the first matmul: cuBLAS loaded, a handle and a workspace for the process
            self._workspace = cp.empty(cublas.WORKSPACE_BYTES, dtype=cp.uint8)
            self._gemm = cublas.CublasGemm(
                cublas.load_library(), self._workspace.data.ptr, cublas.WORKSPACE_BYTES
            )
        x, w = cp.ascontiguousarray(x), cp.ascontiguousarray(w)
        out = cp.empty((x.shape[0], w.shape[0]), dtype=x.dtype)  # [T, N]
        if bias is not None:
            out[...] = bias  # a real copy: never let cuBLAS write into the bias itself
        self._gemm.matmul_t(x, w, out, dtype_name(x), bias is not None, cp.cuda.get_current_stream().ptr)
        return out


class CudaOps:
    """The Backend interface (minisarathi/backends/base.py) over one launcher and one activation dtype."""

    def __init__(self, launcher, dtype: str = "float32"):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        self.launcher = launcher
        self.device = launcher.device
        self.xp = launcher.xp
        self.dtype = dtype
        self.activation_dtype = STORAGE_DTYPES[dtype]  # of activations, weights and the KV cache
        self._uploads: dict[tuple[int, str], tuple[np.ndarray, object]] = {}
        self._checked_positions: np.ndarray | None = None  # the positions array rope_store_kv last checked
        # (context_lens, plan, items and rows on the device) by batch, or by graph bucket (kept: graphs read
        # them)
        self._decode_plans: dict[tuple, tuple] = {}
        # paged_attention's work items and reduce tokens per graph bucket, kept for the same reason: a
        # captured graph holds only their addresses, and the upload cache drops what it holds every few steps
        self._bucket_chunk_arrays: dict[tuple, tuple] = {}
        self._shared_mem_opt_in: dict[int, int] = {}  # id(kernel) -> dynamic shared memory allowed
        self._quant_fallbacks: set[str] = set()  # reasons quantized weights were dequantized, logged once
        # Kernel launches and cuBLAS calls issued so far (docs/performance.md counts them per step).
        # CuPy's own element-wise kernels (copies, fancy indexing) are not counted.
        self.launches = 0

    # ---- placement -------------------------------------------------------------------------------
    def weight(self, tensor: CheckpointTensor | np.ndarray):
        """A weight as a device array in the activation dtype, or a quantized matrix as a QuantWeight
        (compact, for quant_linear.cu) where the kernels take it. A loader CheckpointTensor goes up in its
        stored dtype (16-bit bits as they are) and is converted on the device only if that differs from
        the activation dtype; any other array is taken as float32 values."""
        if isinstance(tensor, CheckpointTensor) and tensor.dtype == "quantized":
            placed = self._quant_weight(tensor.data)
            if placed is not None:
                return placed
        if not isinstance(tensor, CheckpointTensor) or tensor.dtype == "quantized":
            tensor = CheckpointTensor("float32", np.asarray(tensor, dtype=np.float32))
        return _aligned(convert(self.launcher.to_device(tensor.data), tensor.dtype, self.dtype), "weight")

    def linear_weight(self, placed):
        return placed  # cuBLAS reads the [N, K] weight as it is; a QuantWeight is packed already

    def _quant_weight(self, layout) -> QuantWeight | None:
        """`layout` on the device in quant_linear.cu's form, or None (logged once per reason) where the
        kernels do not take it and it is dequantized instead."""
        reason = (
            "float32 activations (the kernels feed 16-bit tensor cores)" if self.dtype == "float32" else None
        )
        parts = layout.parts if isinstance(layout, Stacked) else (layout,)
        forms = [] if reason else [_quant_form(p) for p in parts]
        reason = reason or next((f for f in forms if isinstance(f, str)), None)
        if reason is not None:
            if reason not in self._quant_fallbacks:
                self._quant_fallbacks.add(reason)
                log.info("quantized %s weights dequantized at load: %s", layout.source, reason)
            return None
        to = self.launcher.to_device
        placed = []
        for form, codes, scale, minimum, group in forms:
            N, K = codes.shape
            Np, Kp = -(-N // QL["QL_BN"]) * QL["QL_BN"], -(-K // QL["QL_BK"]) * QL["QL_BK"]
            scale_t, min_t = (
                None
                if a is None
                else _pad(a.astype(np.float16), (Np, Kp // group)).T.copy()  # fp16[Kp/g, Np]
                for a in (scale, minimum)
            )
            packed = _aligned(to(_pack_codes(_pad(codes, (Np, Kp)), form)), "quantized weight")
            scale_d = _aligned(to(scale_t), "quantized scales")
            min_d = scale_d if min_t is None else _aligned(to(min_t), "quantized minimums")
            placed.append(QuantPart(form, packed, scale_d, min_d, group, (N, K), Np))
        return QuantWeight(tuple(placed))

    def zeros(self, shape: tuple[int, ...]):
        """A zeroed device array in the activation dtype (the KV cache is made of these)."""
        return _aligned(self.xp.zeros(shape, dtype=self.activation_dtype), "KV cache / zeros")

    def constant(self, array: np.ndarray):
        """A float32 device copy of a host table that stays float32 whatever the activation dtype
        (config.rope_cos_sin())."""
        return _aligned(self.launcher.to_device(np.asarray(array, dtype=np.float32)), "constant")

    def free_memory_bytes(self) -> int | None:
        """Device memory free now (the engine sizes the KV cache from it once the weights are placed);
        None on the emulator, whose arrays are host memory."""
        if self.xp is np:
            return None
        self.xp.get_default_memory_pool().free_all_blocks()  # blocks CuPy keeps cached count as used
        free, _total = self.xp.cuda.runtime.memGetInfo()
        return int(free)

    def to_numpy(self, x) -> np.ndarray:
        """float32 NumPy copy of a device array."""
        return to_float32(self.launcher.to_host(x), self.dtype)

    def new_sampler(self, vocab_size: int, seed: int = 0, eos_token_ids: tuple[int, ...] = ()) -> GpuSampler:
        """Samples on the device: only the sampled ids (and requested logprobs) cross to the host."""
        return GpuSampler(self, vocab_size, seed, eos_token_ids)

    def _metadata(self, array: np.ndarray, dtype=np.int32):
        if not isinstance(array, np.ndarray):
            return array  # already on the device
        return self._upload_once(array, lambda: np.asarray(array, dtype=dtype))

    def upload_batch(self, batch: Batch, into=None):
        """A step's int32 metadata in one host-to-device copy instead of one per array: the batch's arrays are
        packed (each at a 16-byte boundary) into one buffer, and each op then finds its array's device view in
        the upload cache. Called once per step, before the layers. Returns the device buffer.
        into: a buffer an earlier call returned for a batch of the same shapes (a CUDA graph bucket's static
        buffer, which the captured kernels read): the copy goes there instead of into a new one.
        Overlap: the rows of input_ids that take the previous step's sampled ids (an OverlapBatch's
        previous_ids, engine/overlap.py) get them on the device, after the copy. previous_rows and
        previous_sources travel in the copy whenever set (a graph bucket's batch always sets them, so that its
        packed size does not change)."""
        arrays = [
            batch.input_ids,
            batch.positions,
            batch.slot_mapping,
            batch.query_start,
            batch.context_lens,
            batch.block_tables,
            batch.logits_indices,
        ]
        if getattr(batch, "previous_rows", None) is not None:
            arrays += [batch.previous_rows, batch.previous_sources]
        if len(self._uploads) > 32 - len(arrays):  # only between steps: a step's arrays live through the step
            self._uploads.clear()
        starts = np.cumsum([0] + [-(-a.size // 4) * 4 for a in arrays])  # int32 elements, 16-byte aligned
        packed = np.zeros(int(starts[-1]), np.int32)  # int32[sum of padded sizes]
        for array, start in zip(arrays, starts):
            packed[start : start + array.size] = array.ravel()
        if into is None:
            device = self.launcher.to_device(packed)
        else:
            if into.shape != packed.shape:
                raise ValueError(
                    f"into: a buffer of {packed.size} int32 is needed for this batch, got {into.shape}"
                )
            device = into
            self.launcher.copy_to_device(device, packed)
        views = [
            device[start : start + array.size].reshape(array.shape) for array, start in zip(arrays, starts)
        ]
        for array, view in zip(arrays[:7], views):
            self._upload_once(array, lambda: None, view=view)
        if getattr(batch, "previous_ids", None) is not None:  # tokens the host does not know yet, taken there
            input_ids, rows, sources = views[0], views[7], views[8]
            input_ids[rows] = batch.previous_ids[sources]
        return device

    def _upload_once(self, source: np.ndarray, make, what: str = "", view=None):
        """Device copy of make(), computed once per `source` array and `what` is derived from it. Batch
        arrays are immutable and shared by every layer of a step, so each is uploaded once per step, not
        once per layer."""
        cached = self._uploads.get((id(source), what))
        if cached is not None and cached[0] is source:  # holding `source` keeps its id from being reused
            return cached[1]
        if len(self._uploads) >= 256:  # ops called without upload_batch (tests, benchmarks): the engine's
            self._uploads.clear()  # steps empty it in upload_batch, never while a step's kernels may read it
        device = view if view is not None else self.launcher.to_device(make())
        self._uploads[(id(source), what)] = (source, device)
        return device

    def _kernel(self, file: str, name: str, like):
        """The instantiation of a templated kernel for `like`'s dtype; every caller launches it once."""
        self.launches += 1
        return self.launcher.kernel(file, f"{name}<{CXX_TYPES[dtype_name(like)]}>")

    def _plain_kernel(self, file: str, name: str):
        self.launches += 1
        return self.launcher.kernel(file, name)

    def _check(self, x, name: str):
        if x.dtype != self.activation_dtype:
            raise ValueError(f"{name} must have dtype {self.activation_dtype} ({self.dtype}), got {x.dtype}")

    # ---- ops ---------------------------------------------------------------------------------------
    def embedding(self, table, ids):
        if isinstance(table, QuantWeight):
            return self._quant_embedding(table, ids)
        self._check(table, "table")
        ids_host = np.asarray(ids) if isinstance(ids, np.ndarray) else None
        V, H = table.shape
        if ids_host is not None and len(ids_host) and (ids_host.min() < 0 or ids_host.max() >= V):
            raise ValueError(f"ids must be in [0, {V}), got values {ids_host.min()}..{ids_host.max()}")
        T = len(ids)
        out = self.xp.empty((T, H), dtype=table.dtype)
        if T:
            self._kernel("embedding.cu", "embedding_kernel", table)(
                (_grid_stride_blocks(T * H),),
                (256,),
                (table, self._metadata(ids), out, np.int32(T), np.int32(V), np.int32(H)),
            )
        return out

    def _quant_embedding(self, table: QuantWeight, ids):
        """Rows `ids` of a quantized table [V, H], dequantized to the activation dtype: [T, H]."""
        (part,) = table.parts  # an embedding table is one matrix, never a stack
        V, H = part.shape
        ids_host = np.asarray(ids) if isinstance(ids, np.ndarray) else None
        if ids_host is not None and len(ids_host) and (ids_host.min() < 0 or ids_host.max() >= V):
            raise ValueError(f"ids must be in [0, {V}), got values {ids_host.min()}..{ids_host.max()}")
        out = self.xp.empty((len(ids), H), dtype=self.activation_dtype)
        if len(ids):
            self._plain_kernel(
                "quant_linear.cu", f"quant_embedding_kernel<{CXX_TYPES[self.dtype]}, {part.form}>"
            )(
                (_grid_stride_blocks(len(ids) * H),),
                (256,),
                (
                    part.packed,
                    part.scale,
                    part.minimum,
                    self._metadata(ids),
                    out,
                    np.int32(len(ids)),
                    np.int32(H),
                    np.int32(part.padded_rows),
                    np.int32(part.group.bit_length() - 1),
                ),
            )
        return out

    def rms_norm(self, x, w, eps: float):
        """x[T, H], or a q/k view x[T, heads, D] normed per head where it lies (a copy would be host work
        that a graph capture on the emulator misses)."""
        self._check(x, "x")
        x = self.xp.ascontiguousarray(x) if x.ndim == 2 else x
        heads, H = (1, x.shape[1]) if x.ndim == 2 else x.shape[1:]
        token_stride = H if x.ndim == 2 else _row_stride(x, "x")
        out = self.xp.empty(x.shape, x.dtype)
        if x.shape[0]:
            self._kernel("rms_norm.cu", "rms_norm_kernel", x)(
                (x.shape[0] * heads,),
                (_threads(H),),
                (x, w, out, np.int32(H), np.float32(eps), np.int32(heads), np.int64(token_stride)),
            )
        return out

    def add_rms_norm(self, x, residual, w, eps: float):
        self._check(x, "x")
        self._check(residual, "residual")
        x = self.xp.ascontiguousarray(x)
        if not residual.flags.c_contiguous:
            raise ValueError("residual must be contiguous: it is updated in place")
        out = self.xp.empty_like(x)
        T, H = x.shape
        if T:
            self._kernel("rms_norm.cu", "add_rms_norm_kernel", x)(
                (T,), (_threads(H),), (x, residual, w, out, np.int32(H), np.float32(eps))
            )
        return out, residual

    def linear(self, x, w, bias=None, splits: int | None = None):
        """x[T, K] @ w[N, K].T (+ bias): cuBLAS, or quant_linear.cu for a QuantWeight (`splits` forces its
        number of k splits)."""
        self._check(x, "x")
        if isinstance(w, QuantWeight):
            return self._quant_linear(x, w, bias, splits)
        self.launches += 1
        return self.launcher.matmul_t(x, w, bias)

    def _quant_linear(self, x, w: QuantWeight, bias, splits: int | None):
        x = _aligned(self.xp.ascontiguousarray(x), "x")
        M, K = x.shape
        if K != w.shape[1]:
            raise ValueError(f"x has {K} features, the quantized weight {w.shape[1]}")
        out = self.xp.empty((M, w.shape[0]), dtype=x.dtype)  # [M, N]
        col0 = 0
        for part in w.parts:
            n = part.shape[0]
            if M:
                part_bias = None if bias is None else bias[col0 : col0 + n]
                self._quant_part(x, part, part_bias, out, col0, splits)
            col0 += n
        return out

    def _quant_part(self, x, part: QuantPart, bias, out, col0: int, splits: int | None) -> None:
        """Writes out[:, col0 : col0 + N] = x @ part^T (+ bias): quant_linear_kernel, the decode tile for up
        to QL_DECODE_ROWS rows, K split over the grid where it is too small to fill the GPU."""
        M, K = x.shape
        N = part.shape[0]
        decode = M <= QL["QL_DECODE_ROWS"]
        rows = QL["QL_DECODE_ROWS"] if decode else QL["QL_PREFILL_ROWS"]
        stages = QL["QL_DECODE_STAGES"] if decode else QL["QL_PREFILL_STAGES"]
        unit = 512 if part.form == QL["QL_UINT4"] else 1024
        smem = stages * (
            rows * (QL["QL_BK"] + QL["QL_PAD"]) * x.dtype.itemsize
            + 4 * unit
            + 4 * QL["QL_SCALE_ROWS"] * QL["QL_BN"]
        )
        grid = (part.padded_rows // QL["QL_BN"], -(-M // rows))
        tiles = -(-K // QL["QL_BK"])
        if splits is None:
            splits = _quant_splits(grid[0] * grid[1], tiles, self.launcher.multiprocessors)
        split_tiles = -(-tiles // min(splits, tiles))
        splits = -(-tiles // split_tiles)
        partial = self.xp.empty((splits, M, N) if splits > 1 else (1,), dtype=np.float32)
        has_bias = np.int32(bias is not None)
        bias = x if bias is None else bias  # unread
        kernel = self._plain_kernel(
            "quant_linear.cu", f"quant_linear_kernel<{CXX_TYPES[self.dtype]}, {part.form}, {rows}>"
        )
        self._allow_shared_mem(kernel, smem)
        kernel(
            (*grid, splits),
            (QL["QL_THREADS"],),
            (
                x,
                part.packed,
                part.scale,
                part.minimum,
                bias,
                out,
                partial,
                np.int32(M),
                np.int32(N),
                np.int32(K),
                np.int32(part.padded_rows),
                np.int32(part.group.bit_length() - 1),
                np.int32(split_tiles),
                np.int32(out.shape[1]),
                np.int32(col0),
                has_bias,
            ),
            shared_mem=smem,
        )
        if splits > 1:
            self._plain_kernel("quant_linear.cu", f"quant_linear_reduce_kernel<{CXX_TYPES[self.dtype]}>")(
                (_grid_stride_blocks(M * N),),
                (256,),
                (
                    partial,
                    bias,
                    out,
                    np.int32(M),
                    np.int32(N),
                    np.int32(splits),
                    np.int32(out.shape[1]),
                    np.int32(col0),
                    has_bias,
                ),
            )

    def rope_store_kv(self, q, k, v, k_cache, v_cache, positions, slot_mapping, cos_sin) -> None:
        """One launch: rotates q[T, Hq, D] in place and writes the rotated k[T, Hk, D] and v into the cache at
        slot_mapping (negative: not stored); k and v are read only. cos_sin:
        self.constant(config.rope_cos_sin()). q, k, v may be row-strided views of one QKV array."""
        T, Hq, D = q.shape
        Hk = k.shape[1]
        if D % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {D}")
        if cos_sin.dtype != np.float32 or cos_sin.ndim != 2 or cos_sin.shape[1] != D:
            raise ValueError(
                f"cos_sin must be float32[positions, {D}] (ops.constant(config.rope_cos_sin())), "
                f"got {cos_sin.dtype}{list(cos_sin.shape)}"
            )
        if not T:
            return
        if isinstance(positions, np.ndarray):
            if self._checked_positions is not positions:  # once per step, not once per layer
                _check_positions(positions, cos_sin.shape[0])
                self._checked_positions = positions
            positions = self._metadata(positions)
        items = (Hq + Hk) * D // 2 + Hk * D
        vector = VECTOR_BYTES // q.dtype.itemsize if (D // 2) % (VECTOR_BYTES // q.dtype.itemsize) == 0 else 1
        self._kernel("rope_store_kv.cu", "rope_store_kv_kernel", q)(
            (T,),
            (_threads(items // vector),),
            (
                q,
                k,
                v,
                k_cache,
                v_cache,
                positions,
                self._metadata(slot_mapping),
                cos_sin,
                np.int32(Hq),
                np.int32(Hk),
                np.int32(D),
                np.int32(k_cache.shape[2]),
                np.int64(_row_stride(q, "q")),
                np.int64(_row_stride(k, "k")),
                np.int64(_row_stride(v, "v")),
            ),
        )

    def paged_attention(self, q, k_cache, v_cache, batch: Batch, scale: float, window: int | None = None):
        """[T, Hq, D] attention of each query over its sequence's cached keys 0..position (with a sliding
        window, position - window + 1..position; the kernels take 0 for none). One launch per kind
        of row, over disjoint rows of one output: decodes (query runs of one token) to decode_attention.cu,
        longer runs (prefill chunks) of 16-bit models to prefill_attention.cu (tensor cores), and what those
        do not take (float32 prefills, shapes they do not support) to paged_attention.cu."""
        T, Hq, D = q.shape
        Hk, block_size = k_cache.shape[1], k_cache.shape[2]
        if Hq % Hk:
            raise ValueError(f"num_q_heads ({Hq}) must be a multiple of num_kv_heads ({Hk})")
        group = Hq // Hk
        max_rows, max_head_dim = PA["PA_MAX_ROWS"], PA["PA_MAX_HEAD_DIM"]
        if group > max_rows or D > max_head_dim:
            raise ValueError(
                f"paged_attention supports up to {max_rows} query heads per KV head and head_dim "
                f"<= {max_head_dim}, got {group} and {D}"
            )
        out = self.xp.empty((T, Hq, D), dtype=q.dtype)
        if T == 0:
            return out
        q_lens = np.diff(batch.query_start)  # int32[S]
        decodes = q_lens == 1
        if not (
            decode_plan.supports(self.dtype, q.dtype.itemsize, Hq, Hk, D, block_size, k_cache.shape[0])
            and _is_16_byte_aligned(q)
        ):
            decodes[:] = False
        prefills = q_lens > 1
        if not (self.dtype != "float32" and D in PREFILL_HEAD_DIMS and group <= PF["PF_ROWS"]):
            prefills[:] = False
        window = np.int32(window or 0)
        if decodes.any() and prefills.any():
            # A hybrid step: the decodes' output rows are disjoint from the chunks', so their K/V reads run on
            # a second stream, under the prefill's tensor-core work, and the step joins them before going on.
            with self.launcher.side_stream():
                self._decode_attention(q, k_cache, v_cache, batch, scale, out, decodes, window)
            self._prefill_attention(q, k_cache, v_cache, batch, scale, out, window)
            self.launcher.join_side_stream()
        elif decodes.any():
            self._decode_attention(q, k_cache, v_cache, batch, scale, out, decodes, window)
        elif prefills.any():
            self._prefill_attention(q, k_cache, v_cache, batch, scale, out, window)
        rest = ~(decodes | prefills)
        if rest.any():
            self._chunk_attention(q, k_cache, v_cache, batch, scale, out, rest, window)
        return out

    def _decode_attention(
        self, q, k_cache, v_cache, batch: Batch, scale: float, out, decodes: np.ndarray, window: np.int32
    ) -> None:
        """decode_attention.cu for the sequences where `decodes` (bool[S]) is set: one query token each."""
        T, Hq, D = q.shape
        Hk, block_size = k_cache.shape[1], k_cache.shape[2]
        plan, items, rows = self._decode_plan(batch, decodes, Hq, Hk, D, q.dtype.itemsize, block_size, window)
        xp = self.xp
        slots = max(1, plan.num_slots)
        partial_out = xp.empty((slots, Hq, D), dtype=np.float32)
        partial_max = xp.empty((slots, Hq), dtype=np.float32)
        partial_sum = xp.empty((slots, Hq), dtype=np.float32)
        self.launches += 1
        kernel = self.launcher.kernel(
            "decode_attention.cu",
            f"decode_attention_kernel<{CXX_TYPES[self.dtype]}, {plan.group_tile}, {plan.lanes}>",
        )
        self._allow_shared_mem(kernel, plan.shared_mem)
        kernel(
            (len(plan.items), Hk * plan.head_chunks),
            (decode_plan.THREADS,),
            (
                q,
                k_cache,
                v_cache,
                items,
                self._metadata(batch.block_tables),
                self._metadata(batch.context_lens),
                out,
                partial_out,
                partial_max,
                partial_sum,
                np.int32(Hq),
                np.int32(Hk),
                np.int32(D),
                np.int32(block_size.bit_length() - 1),
                np.int32(batch.block_tables.shape[1]),
                np.int64(_row_stride(q, "q")),
                np.float32(scale),
                np.int32(plan.table_capacity),
                window,
            ),
            shared_mem=plan.shared_mem,
        )
        if len(plan.rows):
            self._kernel("decode_attention.cu", "decode_attention_reduce_kernel", q)(
                (len(plan.rows), Hq),
                (_threads(D, 128),),
                (
                    partial_out,
                    partial_max,
                    partial_sum,
                    rows,
                    self._metadata(batch.context_lens),
                    out,
                    np.int32(Hq),
                    np.int32(D),
                    window,
                ),
            )

    def _decode_plan(
        self,
        batch: Batch,
        decodes: np.ndarray,
        Hq: int,
        Hk: int,
        D: int,
        itemsize: int,
        block_size: int,
        window: np.int32,
    ):
        """(plan, its items and rows on the device) for the decode rows of a batch. One plan per step and
        window, shared by the layers; a graph bucket's batch (the plan_context_len of a BucketBatch,
        decode_graphs.py) has one plan for the bucket's life, for rows of up to that many keys (the kernels
        take each row's keys from context_lens), whose device arrays stay here because its graph reads them.
        A sliding window: the rows are planned for the keys in it, as the kernel cuts them."""
        capacity = getattr(batch, "plan_context_len", None)
        bucket = capacity is not None
        key = (("bucket", batch.num_seqs, capacity) if bucket else (id(batch.context_lens),)) + (
            Hq,
            Hk,
            D,
            itemsize,
            block_size,
            int(window),
        )
        cached = self._decode_plans.get(key)
        if cached is None or not (bucket or cached[0] is batch.context_lens):
            seqs = np.flatnonzero(decodes)
            shape = Hq, Hk, D, self.dtype, itemsize, block_size, self.launcher.multiprocessors
            spans = batch.context_lens[seqs] if window == 0 else np.minimum(batch.context_lens[seqs], window)
            if bucket:
                span = capacity if window == 0 else min(capacity, int(window))
                plan = decode_plan.bucket_plan(batch.query_start[seqs], seqs, span, *shape)
            else:
                plan = decode_plan.plan(batch.query_start[seqs], seqs, spans, *shape)
            if not bucket and len(self._decode_plans) >= 8:
                self._decode_plans = {k: v for k, v in self._decode_plans.items() if k[0] == "bucket"}
            to = self.launcher.to_device
            cached = self._decode_plans[key] = (batch.context_lens, plan, to(plan.items), to(plan.rows))
        return cached[1:]

    def _chunk_attention(
        self, q, k_cache, v_cache, batch: Batch, scale: float, out, selected: np.ndarray, window: np.int32
    ) -> None:
        """paged_attention.cu for the query runs of the sequences where bool[S] `selected` holds (any run
        length, any shape)."""
        T, Hq, D = q.shape
        Hk, block_size = k_cache.shape[1], k_cache.shape[2]
        xp = self.xp
        tile_tokens = max(1, PA["PA_MAX_ROWS"] // (Hq // Hk))
        capacity = getattr(batch, "plan_context_len", None)  # a BucketBatch's (model/decode_graphs.py)
        bucket = capacity is not None
        if (
            bucket
        ):  # a graph bucket's run: fixed work, and partitions for the longest context the bucket allows
            key = (batch.num_seqs, tile_tokens)
            if key not in self._bucket_chunk_arrays:
                tokens = np.flatnonzero(np.repeat(selected, np.diff(batch.query_start))).astype(np.int32)
                self._bucket_chunk_arrays[key] = (
                    self.launcher.to_device(_work_items(batch.query_start, tile_tokens, selected)),
                    self.launcher.to_device(tokens),
                )
            items, tokens = self._bucket_chunk_arrays[key]
            longest = capacity
        else:
            items = self._upload_once(
                batch.query_start,
                lambda: _work_items(batch.query_start, tile_tokens, selected),
                "paged_attention work",
            )
            longest = int(batch.context_lens[selected].max())
        # Partitions past a row's last key write nothing the reduce reads (it merges those its position
        # spans).
        partitions = max(1, math.ceil(longest / PA_PARTITION_SIZE))
        key_tile, smem = _attention_tiling(D, q.dtype.itemsize)
        if partitions > 1:
            partial_out = xp.empty((partitions, T, Hq, D), dtype=np.float32)
            partial_max = xp.empty((partitions, T, Hq), dtype=np.float32)
            partial_sum = xp.empty((partitions, T, Hq), dtype=np.float32)
        else:
            partial_out = partial_max = partial_sum = xp.empty((1,), dtype=np.float32)
        positions = self._metadata(batch.positions)
        self._kernel("paged_attention.cu", "paged_attention_kernel", q)(
            (len(items), Hk, partitions),
            (PA["PA_THREADS"],),
            (
                q,
                k_cache,
                v_cache,
                items,
                positions,
                self._metadata(batch.block_tables),
                out,
                partial_out,
                partial_max,
                partial_sum,
                np.int32(T),
                np.int32(Hq),
                np.int32(Hk),
                np.int32(D),
                np.int32(block_size),
                np.int32(batch.block_tables.shape[1]),
                np.int64(_row_stride(q, "q")),
                np.float32(scale),
                np.int32(PA_PARTITION_SIZE),
                np.int32(key_tile),
                window or np.int32(2**31 - 1),  # the kernel's span: every key back to 0
            ),
            shared_mem=smem,
        )
        if partitions > 1:
            if not bucket:
                tokens = self._upload_once(
                    batch.query_start,
                    lambda: np.flatnonzero(np.repeat(selected, np.diff(batch.query_start))).astype(np.int32),
                    "paged_attention tokens",
                )
            self._kernel("paged_attention.cu", "paged_attention_reduce_kernel", q)(
                (len(tokens), Hq),
                (_threads(D, 128),),
                (
                    partial_out,
                    partial_max,
                    partial_sum,
                    positions,
                    tokens,
                    out,
                    np.int32(T),
                    np.int32(Hq),
                    np.int32(D),
                    np.int32(PA_PARTITION_SIZE),
                    window,
                ),
            )

    def _allow_shared_mem(self, kernel, nbytes: int) -> None:
        """Lets `kernel` launch with `nbytes` of dynamic shared memory. A GPU refuses static + dynamic above
        48 KiB unless the kernel opted in (cuFuncSetAttribute): done here once per kernel and size, not per
        step. The static size is the kernel's own (CuPy's and the emulator's `attributes`)."""
        allowed = self._shared_mem_opt_in.get(id(kernel))
        if allowed is None:
            allowed = SMEM_BUDGET - kernel.attributes["shared_size_bytes"]
        if nbytes > allowed:
            # Never lower a limit set through another CudaOps: kernels of one module are shared.
            allowed = max(nbytes, kernel.max_dynamic_shared_size_bytes)
            kernel.max_dynamic_shared_size_bytes = allowed
        self._shared_mem_opt_in[id(kernel)] = allowed

    def _prefill_attention(
        self,
        q,
        k_cache,
        v_cache,
        batch: Batch,
        scale: float,
        out,
        window: np.int32,
        splits: int | None = None,
    ) -> None:
        """Writes the rows of out[T, Hq, D] that belong to query runs longer than one token. A grid too small
        to fill the GPU is split along the keys (_prefill_splits; `splits` forces a number), each split's
        partials merged by paged_attention_reduce_kernel."""
        T, Hq, D = q.shape
        Hk, block_size = k_cache.shape[1], k_cache.shape[2]
        group = Hq // Hk
        selected = np.diff(batch.query_start) > 1
        # Latest tokens first: they have the most keys, and a GPU starts CTAs in grid order, so the long ones
        # start early and the short ones fill the tail (causal work grows along a chunk).
        work = self._upload_once(
            batch.query_start,
            lambda: np.ascontiguousarray(
                _work_items(batch.query_start, PF["PF_ROWS"] // group, selected)[::-1]
            ),
            "prefill_attention work",
        )
        tiles = -(-int(batch.context_lens[selected].max()) // PF["PF_KEYS"])  # key tiles of the longest run
        if splits is None:
            splits = _prefill_splits(len(work) * Hk, tiles, self.launcher.multiprocessors)
        split_tiles = -(-tiles // splits)
        splits = -(-tiles // split_tiles)
        stages = 3 if D <= PF["PF_THREE_STAGE_MAX_HEAD_DIM"] else 2
        # Q, the stages' K and V tiles, then the stages' cache rows (int64).
        smem = (PF["PF_ROWS"] + 2 * stages * PF["PF_KEYS"]) * (
            D + PF["PF_PAD"]
        ) * q.dtype.itemsize + 8 * stages * PF["PF_KEYS"]
        shape = (splits, T, Hq) if splits > 1 else (1,)
        partial_out, partial_max, partial_sum = (
            self.xp.empty(s, dtype=np.float32) for s in (shape + (D,), shape, shape)
        )
        positions = self._metadata(batch.positions)
        kernel = self._plain_kernel(
            "prefill_attention.cu", f"prefill_attention_kernel<{CXX_TYPES[self.dtype]}, {D}>"
        )
        self._allow_shared_mem(kernel, smem)
        kernel(
            (len(work), Hk, splits),
            (PF["PF_THREADS"],),
            (
                q,
                k_cache,
                v_cache,
                work,
                positions,
                self._metadata(batch.block_tables),
                out,
                partial_out,
                partial_max,
                partial_sum,
                np.int32(T),
                np.int32(Hq),
                np.int32(Hk),
                np.int32(block_size),
                np.int32(batch.block_tables.shape[1]),
                np.int64(_row_stride(q, "q")),
                np.float32(scale * math.log2(math.e)),
                np.int32(split_tiles * PF["PF_KEYS"]),
                window,
            ),
            shared_mem=smem,
        )
        if splits > 1:
            tokens = self._upload_once(
                batch.query_start,
                lambda: np.flatnonzero(np.repeat(selected, np.diff(batch.query_start))).astype(np.int32),
                "prefill_attention tokens",
            )
            self._kernel("paged_attention.cu", "paged_attention_reduce_kernel", q)(
                (len(tokens), Hq),
                (_threads(D, 128),),
                (
                    partial_out,
                    partial_max,
                    partial_sum,
                    positions,
                    tokens,
                    out,
                    np.int32(T),
                    np.int32(Hq),
                    np.int32(D),
                    np.int32(split_tiles * PF["PF_KEYS"]),
                    window,
                ),
            )

    def silu_and_mul(self, x):
        self._check(x, "x")
        x = self.xp.ascontiguousarray(x)
        T, two_i = x.shape
        out = self.xp.empty((T, two_i // 2), dtype=x.dtype)
        if T:
            self._kernel("silu_and_mul.cu", "silu_and_mul_kernel", x)(
                (_grid_stride_blocks(T * two_i // 2),), (256,), (x, out, np.int32(T), np.int32(two_i // 2))
            )
        return out

    def gelu_tanh_and_mul(self, x):
        self._check(x, "x")
        x = self.xp.ascontiguousarray(x)
        T, two_i = x.shape
        out = self.xp.empty((T, two_i // 2), dtype=x.dtype)
        if T:
            self._kernel("gemma.cu", "gelu_tanh_and_mul_kernel", x)(
                (_grid_stride_blocks(T * two_i // 2),), (256,), (x, out, np.int32(T), np.int32(two_i // 2))
            )
        return out

    def softcap(self, x, cap: float):
        """In place: x is the logits linear just made (C order)."""
        self._check(x, "x")
        if x.size:
            self._kernel("gemma.cu", "softcap_kernel", x)(
                (_grid_stride_blocks(x.size),), (256,), (x, np.int64(x.size), np.float32(cap))
            )
        return x

    def copy_blocks(self, kv_cache, sources: list[int], destinations: list[int]) -> None:
        pairs = self.launcher.to_device(
            np.array([sources, destinations], np.int32).T.ravel()
        )  # int32[2P]: src, dst
        for k_cache, v_cache in kv_cache:
            for cache in (k_cache, v_cache):
                self._check(cache, "kv cache")
                block_elems = cache[0].size
                self._kernel("copy_blocks.cu", "copy_blocks_kernel", cache)(
                    (len(sources),), (256,), (cache, pairs, np.int32(block_elems))
                )

    # ---- sampling on the device ----------------------------------------------------------------------
    def greedy(self, logits):
        """Device int32[N]: argmax of each row of float32 logits[N, V] (lowest index on ties)."""
        logits = self.xp.ascontiguousarray(logits, dtype=np.float32)
        N, V = logits.shape
        ids = self.xp.empty((N,), dtype=np.int32)
        if N:
            self._plain_kernel("sampling.cu", "argmax_kernel")(
                (N,), (_threads(V, 1024),), (logits, np.int32(V), ids)
            )
        return ids

    def apply_token_bitmask(self, logits, rows, bitmask) -> None:
        """In place on float32 logits[N, V]: row rows[i] (device int64[R]) keeps the tokens whose bits are set
        in bitmask[i] (device uint32[R, ceil(V / 32)]), the others become -inf (structured outputs)."""
        N, V = logits.shape
        if len(rows):
            self._plain_kernel("token_bitmask.cu", "apply_token_bitmask_kernel")(
                (len(rows),),
                (_threads(V, 1024),),
                (logits, np.int32(V), rows, bitmask, np.int32(bitmask.shape[1])),
            )

    def apply_penalties(
        self,
        logits,
        tokens: list[np.ndarray],
        output_counts: list[np.ndarray],
        repetition: np.ndarray,
        frequency: np.ndarray,
        presence: np.ndarray,
    ) -> None:
        """In place on float32 logits[N, V]. Row r: distinct tokens[r] (prompt and output) with their output
        counts; repetition applies to all of them, frequency and presence to output counts."""
        N, V = logits.shape
        offsets = np.zeros(N + 1, dtype=np.int32)
        np.cumsum([len(t) for t in tokens], out=offsets[1:])
        flat_tokens = np.concatenate([np.asarray(t, np.int32) for t in tokens] or [np.zeros(0, np.int32)])
        flat_counts = np.concatenate(
            [np.asarray(c, np.int32) for c in output_counts] or [np.zeros(0, np.int32)]
        )
        if N:
            to = self.launcher.to_device
            self._plain_kernel("sampling.cu", "apply_penalties_kernel")(
                (N,),
                (128,),
                (
                    logits,
                    np.int32(V),
                    to(offsets),
                    to(flat_tokens),
                    to(flat_counts),
                    to(np.asarray(repetition, np.float32)),
                    to(np.asarray(frequency, np.float32)),
                    to(np.asarray(presence, np.float32)),
                ),
            )

    def sample(self, logits, temperature, top_k, top_p, min_p, uniform, ctas_per_row: int | None = None):
        """Device int32[N] ids, one per row of float32 logits[N, V] (already penalized), with per-row
        parameters and uniform[N] in [0, 1) drawn on the host; temperature 0 is greedy (argmax). Rows may be
        split over several CTAs (gpu_sampling.sample_plan; ctas_per_row forces a split)."""
        kernel = self._plain_kernel("sampling.cu", "sample_kernel") if len(logits) else None
        return sample_rows(
            kernel,
            self.launcher,
            self._allow_shared_mem,
            logits,
            temperature,
            top_k,
            top_p,
            min_p,
            uniform,
            ctas_per_row,
        )


@dataclass(frozen=True, eq=False)
class QuantPart:
    """A quantized matrix [N, K] on the device in quant_linear.cu's layout (described at its top)."""

    form: int  # QL_INT8 | QL_UINT4 | QL_FP8
    packed: object  # uint8[Kp / 64 * Np / 16 * unit bytes]: the codes, zero-padded to [Np, Kp]
    scale: object  # float16[Kp / group, Np]
    minimum: object  # float16[Kp / group, Np] for QL_UINT4 (else `scale`, unread)
    group: int
    shape: tuple[int, int]
    padded_rows: int  # Np


@dataclass(frozen=True, eq=False)
class QuantWeight:
    """A linear weight kept quantized on the device: parts [N_i, K] stacked on their rows (a fused weight
    whose parts a file stores in different types), each written into its columns of the output."""

    parts: tuple[QuantPart, ...]

    @property
    def shape(self) -> tuple[int, int]:
        return (sum(p.shape[0] for p in self.parts), self.parts[0].shape[1])

    @property
    def nbytes(self) -> int:
        """Device bytes: the packed codes, scales and minimums (LlamaModel.weight_bytes adds these up)."""
        return sum(
            p.packed.nbytes + p.scale.nbytes + (p.minimum is not p.scale) * p.minimum.nbytes
            for p in self.parts
        )


def _quant_form(layout) -> tuple[int, np.ndarray, np.ndarray, np.ndarray | None, int] | str:
    """(form, codes uint8[N, K], scale float32[N, K / group], minimum float32[N, K / group] or None, group)
    of a quantized layout for quant_linear.cu, or why the kernels do not take it. Codes are the int8
    values' bytes (QL_INT8), 4-bit codes (QL_UINT4) or E4M3 bytes (QL_FP8, the row scale per 32 weights)."""
    if len(layout.shape) != 2:
        return f"a {len(layout.shape)}-d quantized tensor"
    N, K = layout.shape
    if N % 2 or K % 8:
        return f"shape {N} x {K} (rows must be even and columns a multiple of 8)"
    if (
        isinstance(layout, IntGroups)
        and QL["QL_BK"] % layout.group == 0
        and layout.group >= QL["QL_MIN_GROUP"]
    ):
        form = (
            QL["QL_INT8"],
            layout.values.view(np.uint8),
            layout.scale.astype(np.float32),
            None,
            layout.group,
        )
    elif isinstance(layout, UintGroups) and layout.bits == 4:
        form = (QL["QL_UINT4"], layout.codes(), layout.scale, layout.minimum, layout.group)
    elif isinstance(layout, Fp8Rows) and K % 32 == 0:
        if ((layout.values & 0x7F) == 0x7F).any():
            return "FP8 weights that are NaN"
        form = (QL["QL_FP8"], layout.values, np.repeat(layout.scale[:, None], K // 32, axis=1), None, 32)
    else:
        bits = getattr(layout, "bits", 8)
        return (
            f"{type(layout).__name__} of {bits} bits in groups of {getattr(layout, 'group', K)} (no kernel)"
        )
    for a in form[2:4]:
        if a is not None and not np.isfinite(a.astype(np.float16)).all():
            return "scales or minimums outside float16's range"
    return form


def _pad(a: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """a[R, C] with zeros appended to `shape`."""
    return np.pad(a, [(0, shape[0] - a.shape[0]), (0, shape[1] - a.shape[1])])


def _pack_codes(codes: np.ndarray, form: int) -> np.ndarray:
    """quant_linear.cu's packed weights from codes uint8[Np, Kp] (multiples of 64): units of 16 rows x 64
    columns, [Kp / 64][Np / 16], each lane's fragment weights contiguous (the layout at the file's top).
    Row n = 16 nb + 8 j + g, column k = 64 kt + 16 kk + 8 h + 2 t + e0; a fragment's weight e = 2 h + e0."""
    Np, Kp = codes.shape
    c = codes.reshape(Np // 16, 2, 8, Kp // 64, 4, 2, 4, 2)  # nb, j, g, kt, kk, h, t, e0
    if form == QL["QL_UINT4"]:
        c = c.transpose(3, 0, 2, 6, 4, 1, 5, 7).reshape(-1, 2) & 0x0F  # kt, nb, g, t, kk, (nibble 4j + e)
        return (c[:, 0] | (c[:, 1] << 4)).astype(np.uint8)
    return np.ascontiguousarray(c.transpose(3, 0, 1, 2, 6, 4, 5, 7)).reshape(-1)  # kt, nb, j, g, t, kk, e


def _quant_splits(ctas: int, tiles: int, multiprocessors: int) -> int:
    """K splits for a quant_linear grid of `ctas` CTAs over `tiles` k tiles: a weight stream is bound by
    bandwidth only with enough bytes in flight, so a grid of fewer than QUANT_CTAS_PER_SM CTAs per SM is
    split along K into about that many, each split at least QUANT_MIN_SPLIT_TILES tiles long."""
    target = QUANT_CTAS_PER_SM * multiprocessors
    if ctas >= target:
        return 1
    return max(1, min(-(-target // ctas), tiles // QUANT_MIN_SPLIT_TILES))


def _refuse_copy_while_capturing(direction: str) -> None:
    if emulator.capturing():  # CuPy's copies between pageable host memory and the device are synchronous
        raise RuntimeError(
            f"a {direction} copy during a graph capture: CUDA forbids it (copy before or after capturing)"
        )


def _grid_stride_blocks(elements: int) -> int:
    """Blocks of 256 threads for a grid-stride kernel over `elements` (a thread takes up to 16 bytes)."""
    return max(1, min(GRID_STRIDE_BLOCKS, math.ceil(elements / 256)))


def _aligned(array, what: str):
    """The kernels' 16-byte vector loads assume their weights, caches and tables start 16-byte aligned
    (CuPy's allocations are 256-byte aligned, NumPy's 16 or more): refuse one that is not."""
    address = cublas.address(array)
    if address % VECTOR_BYTES:
        raise ValueError(f"{what}: device array at {address:#x} is not {VECTOR_BYTES}-byte aligned")
    return array


def _check_positions(positions: np.ndarray, table_rows: int) -> None:
    if len(positions) and (positions.min() < 0 or positions.max() >= table_rows):
        raise ValueError(
            f"positions must be in [0, {table_rows}) (the RoPE table's rows, max_position_embeddings), "
            f"got {positions.min()}..{positions.max()}"
        )


def _threads(work: int, most: int = 256) -> int:
    """A block size for `work` parallel items: a multiple of 32 (the kernels use warp shuffles)."""
    return max(32, min(most, 32 * math.ceil(work / 32)))


def _row_stride(x, name: str) -> int:
    """Elements between consecutive tokens of x[T, heads, D], whose (heads, D) part must be contiguous."""
    item = x.dtype.itemsize
    if x.strides[2] != item or x.strides[1] != x.shape[2] * item:
        raise ValueError(
            f"{name}: heads and head_dim must be contiguous within a token, got strides {x.strides}"
        )
    return x.strides[0] // item


def _work_items(query_start: np.ndarray, tile_tokens: int, selected: np.ndarray | None = None) -> np.ndarray:
    """int32[W, 3]: (sequence, first token, token count) runs of at most tile_tokens tokens, of the
    sequences where bool[S] `selected` holds (all by default)."""
    q_lens = np.diff(query_start)
    tiles = -(-q_lens // tile_tokens)  # int[S]
    if selected is not None:
        tiles = np.where(selected, tiles, 0)
    seq = np.repeat(np.arange(len(q_lens)), tiles)
    tile_index = np.arange(len(seq)) - np.repeat(np.cumsum(tiles) - tiles, tiles)
    first = query_start[seq] + tile_index * tile_tokens
    count = np.minimum(tile_tokens, query_start[seq + 1] - first)
    return np.stack([seq, first, count], axis=1).astype(np.int32)


def _prefill_splits(ctas: int, tiles: int, multiprocessors: int) -> int:
    """Key splits for a prefill grid of `ctas` CTAs whose longest run spans `tiles` key tiles. A grid of fewer
    than PF_WAVES waves whose last wave is under PF_MIN_FILL full leaves SMs idle (a 512-token chunk at GQA 4:
    128 CTAs for 264 slots) and is split into about PF_WAVES waves; 2048 tokens at GQA 4 (512 CTAs, 1.94
    waves) is not, since partials would cost more than the 3% they fill. Splits keep PF_MIN_SPLIT_KEYS
    keys."""
    resident = multiprocessors * PF["PF_CTAS_PER_SM"]
    waves = ctas / resident
    if waves >= PF_WAVES or waves / math.ceil(waves) >= PF_MIN_FILL:
        return 1
    return max(1, min(math.ceil(PF_WAVES * resident / ctas), tiles * PF["PF_KEYS"] // PF_MIN_SPLIT_KEYS))


def _is_16_byte_aligned(x) -> bool:
    """Rows of x[T, H, D] start on 16-byte boundaries (decode_attention.cu loads Q in 16-byte vectors)."""
    address = cublas.address(x)
    return address % 16 == 0 and x.strides[0] % 16 == 0


def _attention_tiling(head_dim: int, itemsize: int) -> tuple[int, int]:
    """(keys per tile, dynamic shared memory bytes) for paged_attention_kernel: the sizes of the four arrays
    of its shared-memory layout (described in cuda/paged_attention.cu) added up."""
    pitch = head_dim + 4 // itemsize
    for key_tile in range(32, 0, -4):  # a multiple of 4 keeps v_s 16-byte aligned for vector copies
        smem = 4 * PA["PA_MAX_ROWS"] * (head_dim + key_tile) + itemsize * key_tile * (pitch + head_dim)
        if smem <= SMEM_BUDGET:
            return key_tile, smem
    raise ValueError(f"head_dim {head_dim} does not fit paged_attention's shared memory")


def emulated(dtype: str = "float32") -> CudaOps:
    """The CUDA kernels on the CPU emulator (device "cuda-emulated"); arrays are NumPy."""
    return CudaOps(EmulatorLauncher(), dtype)


def gpu(dtype: str = "bfloat16") -> CudaOps:
    """The CUDA kernels on the current CuPy device (device "cuda")."""
    return CudaOps(CupyLauncher(), dtype)
