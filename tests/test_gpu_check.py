"""bench/gpu_check.sh fits the GPU machine: python3 or $PYTHON, a time budget its sections fit in, at most
8 files under $OUT, and, without CuPy or a GPU, a summary saying what is missing and a non-zero exit."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "bench" / "gpu_check.sh"
sys.path.insert(0, str(REPO))
from bench import gpu_check  # noqa: E402


def run_check(tmp_path: Path, **env) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path / "out"
    result = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "OUT": str(out), "PYTHON": sys.executable, "TMPDIR": str(tmp_path), **env})
    return result, out


def files_under(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if p.is_file()]


def test_section_limits_fit_the_budget_and_the_machine():
    limits = [limit for _, limit in gpu_check.SECTIONS.values()]
    outer = int(re.search(r"timeout -k (\d+) (\d+)", SCRIPT.read_text()).group(2))
    kill_grace = int(re.search(r"timeout -k (\d+) (\d+)", SCRIPT.read_text()).group(1))
    assert sum(limits) < gpu_check.TOTAL_BUDGET_S < outer
    assert outer + kill_grace + 15 < 7 * 60      # 15 s for environment.txt (nvidia-smi, a CuPy import)
    text = SCRIPT.read_text()
    assert 'PYTHON="${PYTHON:-python3}"' in text and '"$PYTHON" bench/gpu_check.py' in text


@pytest.mark.skipif(sys.platform != "linux", reason="bash, timeout and mktemp as on the GPU machine")
def test_without_a_gpu_the_summary_says_what_is_missing(tmp_path):
    from minisarathi.backends.devices import resolve_device
    if resolve_device("auto") == "cuda":
        pytest.skip("a GPU is visible: this test is about machines without one")
    result, out = run_check(tmp_path)
    assert result.returncode != 0
    summary = (out / "summary.txt").read_text()
    assert "MISSING" in summary and ("GPU" in summary or "CuPy" in summary)
    assert summary.splitlines()[-1] in result.stdout          # the table is printed last
    assert len(files_under(out)) <= 8
    assert not list(tmp_path.glob("gpu_check.*"))             # the scratch folder is removed


@pytest.mark.skipif(sys.platform != "linux", reason="bash, timeout and mktemp as on the GPU machine")
def test_without_cupy_the_summary_says_what_to_install(tmp_path):
    blocker = tmp_path / "no_cupy" / "cupy"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('CuPy is hidden by this test')\n")
    result, out = run_check(tmp_path, PYTHONPATH=str(blocker.parent))
    assert result.returncode != 0
    summary = (out / "summary.txt").read_text()
    assert "CuPy is not importable" in summary and "pip install cupy-cuda13x" in summary
    assert "CuPy not importable" in (out / "environment.txt").read_text()
    assert len(files_under(out)) <= 8


def nccl_rows(monkeypatch, tmp_path: Path, devices: int) -> list:
    cupy = pytest.importorskip("cupy", reason="CuPy is not installed")
    monkeypatch.setattr(cupy.cuda.runtime, "getDeviceCount", lambda: devices)
    monkeypatch.setattr(gpu_check, "ROWS", [])
    gpu_check.check_nccl(tmp_path)
    return gpu_check.ROWS


def test_the_nccl_section_with_one_gpu_says_skipped_and_fails_nothing(monkeypatch, tmp_path):
    rows = nccl_rows(monkeypatch, tmp_path, devices=1)
    assert [(name, result) for name, result, _ in rows] == [("nccl TP=2", "skipped: one GPU")]
    assert not any(result in gpu_check.FAILURES for _, result, _ in rows)
    assert "nccl" in gpu_check.SECTIONS and list(gpu_check.SECTIONS)[-1] == "nccl"


def test_the_nccl_section_with_two_gpus_and_no_nccl_names_the_install(monkeypatch, tmp_path):
    from cupy.cuda import nccl
    if nccl.available:
        pytest.skip("NCCL is installed here: the section would run tensor parallelism on the (faked) second GPU")
    rows = nccl_rows(monkeypatch, tmp_path, devices=2)
    assert rows == [("nccl TP=2", "MISSING", "NCCL is not loadable by CuPy: pip install 'nvidia-nccl-cu13' (or -cu12)")]
    assert "MISSING" in gpu_check.FAILURES
