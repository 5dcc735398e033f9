"""bench/gpu_check.sh's runner, without a GPU: planted sections that raise inside an op, fail a check,
segfault and hang past their limit each cost only themselves, with their first failing call in the summary;
the sections' order, limits and fallbacks fit the GPU machine; and without CuPy or a GPU the summary says what
is missing."""

import ctypes
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "gpu_check.sh"
sys.path.insert(0, str(REPO))
from bench.gpu_runner import (  # noqa: E402
    CPU,
    DUMP_GRACE_S,
    STAGES,
    Report,
    Result,
    Section,
    advice,
    exit_code,
    run_sections,
)


@pytest.fixture(scope="module")
def gpu_check():
    """Imported here, not at the top: the planted sections' processes import this file, and start faster."""
    from bench import gpu_check

    return gpu_check


# ---- planted sections: module-level, as the runner loads a section by its file and name
# ----------------------


def raises_in_an_op(report):
    from minisarathi.backends.cpu.ops import CpuOps

    report.row("before the error", "ok")
    CpuOps().rms_norm(np.ones((2, 3), np.float32), np.ones(4, np.float32), 1e-5)  # shapes differ: ValueError


def fails_a_check_and_goes_on(report):
    from minisarathi.backends.cpu.ops import CpuOps

    report.check("wrong shapes", CpuOps().silu_and_mul, np.ones(3, np.float32))  # 1-d: IndexError
    report.data["ceiling"] = 4.3e12
    report.row("tokens", "MISMATCH", "request 3 differs")


def segfaults(report):
    report.row("before the crash", "ok")
    ctypes.string_at(0)  # reads address 0: SIGSEGV


def hangs(report):
    report.row("started", "ok")
    time.sleep(60)


def passes(report):
    report.row("after the failures", "ok", f"ceiling {report.earlier('check')['ceiling']:.1e}")


HANG_S = 2  # long enough for its process to start and reach the sleep on a busy machine
PLANTED = [
    Section("raise", raises_in_an_op, 60, None, "correctness", CPU),
    Section("check", fails_a_check_and_goes_on, 60, None, "correctness", CPU),
    Section("segfault", segfaults, 60, None, "graphs", "cuda_graphs=False"),
    Section("hang", hangs, HANG_S, None, "overlap", "overlap=False"),
    Section("pass", passes, 60, None, "speed"),
]


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    out = tmp_path_factory.mktemp("out")
    results = run_sections(PLANTED, out, budget_s=300, title="planted")
    return {r.section.name: r for r in results}, out


def test_every_planted_section_runs_and_fails_alone(planted):
    results, out = planted
    assert {name: r.status for name, r in results.items()} == {
        "raise": "ERROR",
        "check": "ERROR",
        "segfault": "CRASHED",
        "hang": "TIMEOUT",
        "pass": "ok",
    }
    assert results["pass"].rows == [
        ("after the failures", "ok", "ceiling 4.3e+12")
    ]  # read the summary so far
    assert results["hang"].seconds < HANG_S + DUMP_GRACE_S + 1
    assert sorted(p.name for p in out.iterdir()) == ["summary.json", "summary.txt"]


def test_an_exception_names_the_op_and_the_line_that_called_it(planted):
    failure = planted[0]["raise"].failure
    assert failure["error"].startswith("ValueError")
    assert failure["where"].startswith("minisarathi/backends/cpu/ops.py:") and "rms_norm" in failure["where"]
    assert failure["op"] == "CpuOps.rms_norm"
    assert failure["caller"].startswith("tests/system/test_gpu_check.py:")
    assert "raises_in_an_op" in failure["caller"]
    assert planted[0]["raise"].rows[0] == ("before the error", "ok", "")


def test_a_failed_check_is_a_row_and_the_section_goes_on(planted):
    result = planted[0]["check"]
    assert [row[:2] for row in result.rows] == [("wrong shapes", "ERROR"), ("tokens", "MISMATCH")]
    assert result.failure["check"] == "wrong shapes" and result.failure["op"] == "CpuOps.silu_and_mul"


def test_a_crash_or_a_hang_keeps_its_rows_and_where_it_was(planted):
    results = planted[0]
    segfault, hang = results["segfault"], results["hang"]
    assert segfault.failure["error"].startswith("killed by SIGSEGV")
    assert (
        segfault.failure["where"].startswith("tests/system/test_gpu_check.py:")
        and "in segfaults: ctypes.string_at(0)" in segfault.failure["where"]
    )
    assert segfault.rows == [("before the crash", "ok", "")]
    assert hang.failure["error"].startswith(f"TIMEOUT after {HANG_S} s")
    assert "in hangs: time.sleep(60)" in hang.failure["where"]
    assert hang.rows == [("started", "ok", "")]


def test_the_summary_gives_the_fallback_and_each_first_failure(planted):
    results, out = planted
    text = (out / "summary.txt").read_text()
    assert "engine: do not serve on device='cuda' (raise, check failed): use device='cpu'" in text
    assert "segfaults: ctypes.string_at(0)" in text and "hangs: time.sleep(60)" in text
    assert "(op CpuOps.rms_norm, called from tests/system/test_gpu_check.py:" in text
    saved = json.loads((out / "summary.json").read_text())
    assert [s["status"] for s in saved["sections"]] == [r.status for r in results.values()]
    assert exit_code(list(results.values())) == 1


def test_the_fallback_follows_what_failed(gpu_check):
    def fallback(**statuses: str) -> str:  # advice() for gpu_check's sections, all ok but those named
        return advice(
            [Result(s, status=statuses.get(s.name.replace("-", "_"), "ok")) for s in gpu_check.SECTIONS]
        )

    assert fallback() == "serve with the defaults: device='cuda' (CUDA graphs and overlap on)"
    assert fallback(graphs="ERROR", overlap="TIMEOUT", attention="CRASHED") == (
        "serve with device='cuda', cuda_graphs=False, overlap=False; failed without effect on serving: "
        "attention"
    )
    assert fallback(overlap="skipped: the 480 s budget is spent").endswith(
        "not concluded: overlap did not run"
    )
    assert fallback(ops_bfloat16="FAILED", graphs="ERROR").startswith(
        "do not serve on device='cuda' (ops-bfloat16 failed): use device='cpu'"
    )


def test_sections_run_correctness_then_graphs_then_speed_within_the_machines_limits(gpu_check):
    sections = gpu_check.SECTIONS
    assert [STAGES.index(s.stage) for s in sections] == sorted(STAGES.index(s.stage) for s in sections)
    assert sections[0].required and sections[0].name == "env"
    fallbacks = {"correctness": CPU, "graphs": "cuda_graphs=False", "overlap": "overlap=False", "speed": ""}
    assert all(s.fallback == fallbacks[s.stage] for s in sections)
    # a kernel's error raised by its own launch, in the eager sections only
    assert all(s.env.get("CUDA_LAUNCH_BLOCKING") != "1" for s in sections if s.stage != "correctness")
    assert all(
        s.env.get("CUDA_LAUNCH_BLOCKING") == "1" for s in sections if s.name.startswith(("ops", "models"))
    )
    text = SCRIPT.read_text()
    full_limit, quick_limit = map(int, re.findall(r"LIMIT=(\d+)", text))
    # every section gets its whole limit whatever hangs, inside gpu_check.sh's outer limit
    assert (
        sum(s.limit_s for s in sections) <= gpu_check.BUDGET_S["full"] < full_limit <= 510
    )  # 10-minute calls
    assert (
        sum(s.quick_s for s in sections if s.quick_s) <= gpu_check.BUDGET_S["quick"] < quick_limit <= 285
    )  # 5 min
    assert {"env", "compile", "ops-bfloat16", "models", "graphs", "overlap", "model-8b"} <= {
        s.name for s in sections if s.quick_s
    }
    assert 'PYTHON="${PYTHON:-python3}"' in text and '"$PYTHON" bench/gpu_check.py' in text


def test_every_op_of_the_cuda_backend_is_checked_against_numpy(gpu_check):
    from minisarathi.backends import cuda_ops

    methods = {
        m for m in dir(cuda_ops.CudaOps) if not m.startswith("_") and callable(getattr(cuda_ops.CudaOps, m))
    }
    assert methods - gpu_check.PLACEMENT == gpu_check.CHECKED_OPS


def run_check(tmp_path: Path, **env) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path / "out"
    result = subprocess.run(
        ["bash", str(SCRIPT)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OUT": str(out), "PYTHON": sys.executable, **env},
    )
    return result, out


@pytest.mark.skipif(sys.platform != "linux", reason="bash and timeout as on the GPU machine")
def test_without_a_gpu_the_summary_says_what_is_missing(tmp_path):
    from minisarathi.backends.devices import resolve_device

    if resolve_device("auto") == "cuda":
        pytest.skip("a GPU is visible: this test is about machines without one")
    result, out = run_check(tmp_path)
    assert result.returncode == 2
    summary = (out / "summary.txt").read_text()
    assert (
        "MISSING" in summary and ("GPU" in summary or "CuPy" in summary) and "skipped: env failed" in summary
    )
    assert summary.splitlines()[-1] in result.stdout.splitlines()[-1]  # the table is printed last
    assert sorted(p.name for p in out.iterdir()) == [
        "environment.txt",
        "log.txt",
        "summary.json",
        "summary.txt",
    ]


@pytest.mark.skipif(sys.platform != "linux", reason="bash and timeout as on the GPU machine")
def test_without_cupy_the_summary_says_what_to_install(tmp_path):
    blocker = tmp_path / "no_cupy" / "cupy"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('CuPy is hidden by this test')\n")
    result, out = run_check(tmp_path, PYTHONPATH=str(blocker.parent))
    assert result.returncode == 2
    summary = (out / "summary.txt").read_text()
    assert "CuPy is not importable" in summary and "pip install cupy-cuda13x" in summary
    assert "CuPy not importable" in (out / "environment.txt").read_text()


def nccl_rows(gpu_check, monkeypatch, tmp_path: Path, devices: int) -> list:
    cupy = pytest.importorskip("cupy", reason="CuPy is not installed")
    monkeypatch.setattr(cupy.cuda.runtime, "getDeviceCount", lambda: devices)
    report = Report(tmp_path / "result.json", tmp_path / "summary.json", tmp_path, quick=False)
    gpu_check.check_nccl(report)
    return report.rows


def test_the_nccl_section_with_one_gpu_says_skipped_and_fails_nothing(gpu_check, monkeypatch, tmp_path):
    assert nccl_rows(gpu_check, monkeypatch, tmp_path, devices=1) == [
        ("nccl TP=2", "skipped: one GPU", "1 GPU visible; TP over NCCL needs two")
    ]
    assert gpu_check.SECTIONS[-1].name == "nccl"  # last: its rank processes are the likeliest to outlive it


def test_the_nccl_section_with_two_gpus_and_no_nccl_names_the_install(gpu_check, monkeypatch, tmp_path):
    nccl = pytest.importorskip(
        "cupy.cuda.nccl", reason="the section is CuPy's: pip install -e '.[test-cuda]'"
    )

    if nccl.available:
        pytest.skip(
            "NCCL is installed here: the section would run tensor parallelism on the (faked) second GPU"
        )
    assert nccl_rows(gpu_check, monkeypatch, tmp_path, devices=2) == [
        ("nccl TP=2", "MISSING", "NCCL is not loadable by CuPy: pip install 'nvidia-nccl-cu13' (or -cu12)")
    ]
