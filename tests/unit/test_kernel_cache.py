"""CuPy keys its compiled-kernel cache by a kernel file's text and NVRTC options only: the options carry a
digest of every header the file includes, so an edited header never loads a stale cubin."""

import shutil

import pytest

from minisarathi.backends import cuda_ops
from minisarathi.paths import cuda_dir


@pytest.fixture
def kernel_dir(tmp_path, monkeypatch):
    copy = tmp_path / "cuda"
    shutil.copytree(cuda_dir(), copy)
    monkeypatch.setattr(cuda_ops, "cuda_dir", lambda: copy)
    return copy


def test_an_edited_header_changes_the_options_of_the_files_that_include_it(kernel_dir):
    files = cuda_ops.kernel_files()
    before = {file: cuda_ops.nvrtc_options(file) for file in files}
    assert all(f"-I{kernel_dir}" in options for options in before.values())
    (kernel_dir / "vec.cuh").write_text((kernel_dir / "vec.cuh").read_text() + "\n// edited\n")
    after = {file: cuda_ops.nvrtc_options(file) for file in files}
    includes_vec = {"rms_norm.cu", "embedding.cu", "rope_store_kv.cu", "silu_and_mul.cu"}
    assert {file for file in files if after[file] != before[file]} == includes_vec
    (kernel_dir / "common.cuh").write_text((kernel_dir / "common.cuh").read_text() + "\n// edited\n")
    latest = {file: cuda_ops.nvrtc_options(file) for file in files}
    assert all(latest[file] != after[file] for file in files)  # every file includes it
    (kernel_dir / "sampling.cu").write_text((kernel_dir / "sampling.cu").read_text() + "\n// edited\n")
    assert {file: cuda_ops.nvrtc_options(file) for file in files} == latest  # CuPy hashes a .cu's own text


def test_the_gpu_launcher_compiles_with_those_options():
    made = []

    class FakeModule:
        def __init__(self, **kwargs):
            made.append(kwargs)

        def get_function(self, name):
            return name

    class FakeCupy:
        RawModule = FakeModule

    launcher = object.__new__(cuda_ops.CupyLauncher)  # no GPU here: only what kernel() uses
    launcher.xp, launcher._modules, launcher._kernels = FakeCupy, {}, {}
    assert launcher.kernel("rms_norm.cu", "rms_norm_kernel<float>") == "rms_norm_kernel<float>"
    assert made[0]["options"] == cuda_ops.nvrtc_options("rms_norm.cu")
    assert made[0]["code"] == (cuda_dir() / "rms_norm.cu").read_text()
