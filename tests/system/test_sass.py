"""Structure of the compiled kernels, checked without a GPU: NVRTC's cubins for sm_80 and sm_90 (the code
the CUDA backend loads, compiled once per file and architecture by nvrtc_build), ptxas -v for registers,
stack frames and spills (none in any kernel of any file), cuobjdump -sass for the machine code.

Skips with a reason without NVRTC (see nvrtc_build) or cuobjdump + nvdisasm (pip: nvidia-cuda-cuobjdump,
nvidia-cuda-nvdisasm, found through cuda.pathfinder; the `test` extra installs them).
`compile_file` and `functions` are the helpers: SASS split per kernel (mangled name).
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import NamedTuple

import pytest
from nvrtc_build import ARCHITECTURES, build_kernel_file

from minisarathi.backends import cuda_ops, decode_plan

MANGLED_TYPES = {"float": "f", "__half": "6__half", "__nv_bfloat16": "13__nv_bfloat16"}


def _tool(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    try:
        from cuda import pathfinder

        return pathfinder.find_nvidia_binary_utility(name)
    except Exception:
        return None


@functools.lru_cache(maxsize=None)
def compile_file(file: str, arch: str) -> tuple[str, str]:
    """(SASS text, ptxas -v log) of cuda/<file> as NVRTC builds it for the CUDA backend."""
    cuobjdump, nvdisasm = _tool("cuobjdump"), _tool("nvdisasm")
    if cuobjdump is None or nvdisasm is None:
        pytest.skip("cuobjdump/nvdisasm not found: pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm")
    built = build_kernel_file(file, arch)
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "out.cubin"
        cubin.write_bytes(built.cubin)
        env = {**os.environ, "PATH": f"{Path(nvdisasm).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
        sass = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True, env=env)
        assert sass.returncode == 0, sass.stderr
    return sass.stdout, built.log


def functions(sass: str) -> dict[str, list[tuple[int, str]]]:
    """Mangled kernel name -> [(address, instruction)] from cuobjdump -sass output."""
    result: dict[str, list[tuple[int, str]]] = {}
    current = None
    for line in sass.splitlines():
        header = re.match(r"\s*Function : (\S+)", line)
        if header:
            current = result.setdefault(header.group(1), [])
            continue
        instruction = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if instruction and current is not None:
            current.append((int(instruction.group(1), 16), instruction.group(2)))
    return result


def loop_bodies(code: list[tuple[int, str]]) -> list[list[str]]:
    """Instructions between each backward branch's target and the branch: the loops."""
    bodies = []
    for address, text in code:
        target = re.search(r"\bBRA\b.*?0x([0-9a-f]+)\s*$", text)
        if target and int(target.group(1), 16) < address:
            start = int(target.group(1), 16)
            bodies.append([t for a, t in code if start <= a <= address])
    return bodies


class Resources(NamedTuple):
    registers: int
    stack: int  # bytes: the kernel's stack frame, or with calls the cumulative stack size if larger
    spill_stores: int  # bytes
    spill_loads: int


def resources(log: str) -> dict[str, Resources]:
    """Mangled name -> its Resources from a ptxas -v log (nvcc's, or NVRTC's with -Xptxas=-v)."""
    out = {}
    for block in re.split(r"ptxas info\s+: Compiling entry function ", log)[1:]:
        name = block.split("'")[1]
        regs = int(re.search(r"Used (\d+) registers", block).group(1))
        frame = re.search(
            r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", block
        )
        cumulative = re.search(r"(\d+) bytes cumulative stack size", block)
        stack = max(int(frame.group(1)), int(cumulative.group(1)) if cumulative else 0)
        out[name] = Resources(regs, stack, int(frame.group(2)), int(frame.group(3)))
    return out


def local_memory_users(used: dict[str, Resources]) -> dict[str, Resources]:
    """The kernels with a stack frame or spills: local memory, which no kernel here should need."""
    return {name: r for name, r in used.items() if r.stack or r.spill_stores or r.spill_loads}


def decode_instantiations() -> list[tuple[str, str]]:
    return [
        (
            f"decode_attention_kernel<{cuda_ops.CXX_TYPES[d]}, {g}, {lanes}>",
            f"_Z23decode_attention_kernelI{MANGLED_TYPES[cuda_ops.CXX_TYPES[d]]}Li{g}ELi{lanes}E",
        )
        for d, g, lanes in decode_plan.INSTANTIATIONS
    ]


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("file", cuda_ops.kernel_files())
def test_no_kernel_spills_or_has_a_stack_frame(file, arch):
    """Every kernel of the file, every instantiation, as ptxas -v reports it: the per-kernel tests below look
    for local memory in their loops only, and spills also land outside loops (around barriers, row loops)."""
    sass, log = compile_file(file, arch)
    used = resources(log)
    assert set(used) == set(functions(sass)) and len(used) >= len(cuda_ops.name_expressions(file)), (
        list(used),
        list(functions(sass)),
    )
    assert not local_memory_users(used), f"{file} ({arch}): {local_memory_users(used)}"


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_decode_attention_main_loop_streams_16_byte_async_copies(arch):
    sass, log = compile_file("decode_attention.cu", arch)
    kernels, used = functions(sass), resources(log)
    for name, prefix in decode_instantiations():
        mangled = [m for m in kernels if m.startswith(prefix)]
        assert len(mangled) == 1, (name, list(kernels))
        code = kernels[mangled[0]]
        loops = loop_bodies(code)
        # The tile loop holds the wait for a stage and the 16-byte asynchronous copies of a later tile.
        assert any(
            any(t.startswith("DEPBAR") for t in body) and any("LDGSTS.E.BYPASS.128" in t for t in body)
            for body in loops
        ), f"{name} ({arch}): no loop with LDGSTS.128 and its wait"
        assert not any(re.match(r"(LDL|STL)\b", t) for _, t in code), f"{name} ({arch}) uses local memory"
        assert used[mangled[0]].registers <= 192, f"{name} ({arch}) {used[mangled[0]].registers} registers"


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_prefill_attention_main_loop_runs_on_tensor_cores(arch):
    """Every prefill instantiation: the key-tile loop issues HMMA (tensor cores) fed by LDSM (ldmatrix), and
    16-byte asynchronous copies of the next tile with their wait; no local memory, no spills. One softmax step
    of K keys (pf_softmax_keys: the 64-key tile, or at D = 128 half of it in a loop kept rolled, so its body
    appears once in the tile loop) is 2 row blocks x 2 x (K / 8) x (D / 16) HMMA: Q K^T and P V each K/8 n8
    key tiles x D/16 k steps, or K/16 k steps x D/8 n8 dim tiles, per m16 block."""
    kernels = functions(compile_file("prefill_attention.cu", arch)[0])
    for name in cuda_ops.name_expressions("prefill_attention.cu"):
        cxx, head_dim = re.match(r"prefill_attention_kernel<(\w+), (\d+)>", name).groups()
        prefix = f"_Z24prefill_attention_kernelI{MANGLED_TYPES[cxx]}Li{head_dim}E"
        mangled = [m for m in kernels if m.startswith(prefix)]
        assert len(mangled) == 1, (name, list(kernels))
        code = kernels[mangled[0]]
        mma = "HMMA.16816.F32.BF16" if cxx == "__nv_bfloat16" else "HMMA.16816.F32"
        softmax_keys = cuda_ops.PF["PF_KEYS"] // (1 if int(head_dim) <= 96 else 2)  # pf_softmax_keys<D>()
        expected = cuda_ops.PF["PF_WARP_BLOCKS"] * 2 * (softmax_keys // 8) * (int(head_dim) // 16)
        tile_loops = [body for body in loop_bodies(code) if any(t.startswith("HMMA") for t in body)]
        assert tile_loops, f"{name} ({arch}): no loop issues HMMA"
        loop = max(tile_loops, key=len)
        assert sum(t.startswith(mma) for t in loop) == expected, f"{name} ({arch}): HMMA per tile"
        assert any(t.startswith("LDSM.16.M88") for t in loop) and any(
            t.startswith("LDSM.16.MT88") for t in loop
        ), f"{name} ({arch}): K and V fragments not loaded by ldmatrix / ldmatrix.trans"
        assert any("LDGSTS.E.BYPASS.128" in t for t in loop) and any(t.startswith("DEPBAR") for t in loop), (
            f"{name} ({arch}): no 16-byte cp.async of the next tile and its wait in the tile loop"
        )
        assert not any(re.match(r"(LDL|STL)\b", t) for _, t in code), f"{name} ({arch}) uses local memory"


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_sample_kernel_token_loops_read_shared_memory_with_native_atomics(arch):
    """sample_kernel (cuda/sampling.cu): the chunk comes in by 16-byte cp.async; the per-token loops (the
    short loops reading shared memory: max, weights, digit histograms, draw) never touch local memory; the
    digit histograms use native 32-bit shared atomics (a 64-bit shared atomicAdd is a compare-and-swap loop,
    ATOMS.CAS, on sm_90); at most 64 registers, so one 1024-thread CTA fits on an SM."""
    sass, log = compile_file("sampling.cu", arch)
    code = functions(sass)["sample_kernel"]
    assert any("LDGSTS.E.BYPASS.128" in t for _, t in code), arch
    atomics = [t for _, t in code if t.startswith("ATOMS")]
    assert atomics and not any(".CAS" in t for t in atomics), atomics
    token_loops = [
        body for body in loop_bodies(code) if len(body) < 64 and any(t.startswith("LDS") for t in body)
    ]
    assert any(any(t.startswith("ATOMS") for t in body) for body in token_loops), "no histogram loop"
    assert any(any(t.startswith("MUFU.EX2") for t in body) for body in token_loops), "no weights loop"
    for body in token_loops:
        assert not any(re.match(r"(LDL|STL)\b", t) for t in body), (arch, body)
    assert resources(log)["sample_kernel"].registers <= 64


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_quant_linear_main_loop_dequantizes_into_tensor_cores(arch):
    """Every quant_linear instantiation: the k-tile loop issues HMMA fed by LDSM (x fragments by ldmatrix)
    and 128-bit shared loads of the packed weights, with the next tile's 16-byte cp.async and its wait; a
    tile is 4 k16 steps x 2 n8 tiles per unit x m16 blocks per warp: 8 HMMA at the decode tile (one unit,
    one block), 32 at the prefill tile (two units, two blocks). No local memory."""
    kernels = functions(compile_file("quant_linear.cu", arch)[0])
    for name in cuda_ops.name_expressions("quant_linear.cu"):
        match = re.match(r"quant_linear_kernel<(\w+), (\d), (\d+)>", name)
        if not match:
            continue
        cxx, form, rows = match.groups()
        prefix = f"_Z19quant_linear_kernelI{MANGLED_TYPES[cxx]}Li{form}ELi{rows}E"
        mangled = [m for m in kernels if m.startswith(prefix)]
        assert len(mangled) == 1, (name, list(kernels))
        code = kernels[mangled[0]]
        mma = "HMMA.16816.F32.BF16" if cxx == "__nv_bfloat16" else "HMMA.16816.F32"
        loops = [body for body in loop_bodies(code) if any(t.startswith("HMMA") for t in body)]
        assert len(loops) == 1, f"{name} ({arch}): {len(loops)} loops issue HMMA"
        loop = loops[0]
        expected = 8 if int(rows) == cuda_ops.QL["QL_DECODE_ROWS"] else 32
        assert sum(t.startswith(mma) for t in loop) == expected, f"{name} ({arch}): HMMA per tile"
        assert any(t.startswith("LDSM.16.M88.4") for t in loop), f"{name} ({arch}): x not by ldmatrix"
        assert any(t.startswith("LDS.128") for t in loop), f"{name} ({arch}): weights not by 128-bit LDS"
        assert any("LDGSTS.E.BYPASS.128" in t for t in loop) and any(t.startswith("DEPBAR") for t in loop), (
            f"{name} ({arch}): no 16-byte cp.async of the next tile and its wait in the tile loop"
        )
        assert not any(re.match(r"(LDL|STL)\b", t) for _, t in code), f"{name} ({arch}) uses local memory"
