"""Runs check sections one process each, under a time limit each, and keeps a summary that survives a kill.

A section is a top-level function `fn(report, *args)` that adds rows through `report` (Report below). The
runner starts a fresh Python process per section (its own process group), so an exception, a sticky CUDA
error, a segfault or a hang costs that section only. For each it records the first failing call: from the
traceback of an exception, or, after a crash or a time-out, from the Python stacks that faulthandler writes
(on the fatal signal, or on the SIGUSR1 the runner sends at the limit before it kills the group). That call
is the innermost frame of the repository's code, the op (the first frame in minisarathi/) and the section's
line that called it. A section's rows are saved as it adds them, so a crash keeps them; OUT gets summary.txt
and summary.json, rewritten before and after every section, so a kill of the whole run keeps what finished.

    results = run_sections(sections, out=Path("out"), budget_s=480)
"""

from __future__ import annotations

import faulthandler
import importlib.util
import inspect
import json
import linecache
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent
LIBRARY = REPO / "minisarathi"
STAGES = ("correctness", "graphs", "overlap", "speed")  # the order sections run in
FAILURES = ("ERROR", "MISMATCH", "MISSING")  # row results that fail a section
CPU = "device='cpu'"  # the fallback of a wrong kernel: no CUDA at all
DUMP_GRACE_S = 2.0  # at most, after SIGUSR1 and before SIGKILL


@dataclass
class Section:
    name: str
    fn: Callable  # a module-level function(report, *args), loaded by name in the child
    limit_s: float  # in a full run
    quick_s: float | None  # in --quick; None: not in --quick
    stage: str  # one of STAGES
    fallback: str = ""  # what the engine would serve with if this section fails ("" for speed)
    args: tuple = ()
    env: dict = field(default_factory=dict)
    required: bool = False  # if it fails, nothing after it runs (no GPU)


@dataclass
class Result:
    section: Section
    status: str = "pending"  # running, ok, FAILED, ERROR, TIMEOUT, CRASHED, skipped: ...
    seconds: float = 0.0
    limit_s: float = 0.0
    failure: dict | None = None  # the first failing check or call
    rows: list = field(default_factory=list)
    data: dict = field(default_factory=dict)

    @property
    def failed(self) -> bool:
        return self.status in ("FAILED", "ERROR", "TIMEOUT", "CRASHED")


# ---- in the section's process ----------------------------------------------------------------------------


class Report:
    """What a section writes: rows (check, result, detail), data for later sections, its first failure.
    Saved to the runner's result file after every row, so a crash keeps the rows before it."""

    def __init__(self, path: Path, summary: Path, scratch: Path, quick: bool):
        self.path, self.summary, self.scratch, self.quick = path, summary, scratch, quick
        self.rows: list[tuple[str, str, str]] = []
        self.data: dict = {}
        self.failure: dict | None = None

    def row(self, check: str, result: str, detail: str = "") -> None:
        self.rows.append((check, result, detail))
        print(f"  {check:44s} {result:>12s}  {detail}", flush=True)
        if result in FAILURES and self.failure is None:
            self.failure = {"check": check, "error": f"{result}: {detail}"}
        self.save()

    def check(self, name: str, fn: Callable, *args):
        """fn(*args); an exception becomes an ERROR row with its first failing call, and the section goes on,
        unless it is a CUDA runtime or driver error, which poisons the context: then the section ends."""
        try:
            return fn(*args)
        except Exception as exc:
            self.error(exc, name)
            if type(exc).__module__.startswith("cupy_backends.cuda.api"):
                raise SectionEnded from exc
        return None

    def error(self, exc: BaseException, check: str) -> None:
        print(f"[{check}] failed:\n{''.join(traceback.format_exception(exc))}", flush=True)
        failure = {
            "check": check,
            "error": f"{type(exc).__name__}: {exc}".splitlines()[0][:300],
            **first_failing_call(traceback_frames(exc)),
        }
        first = self.failure is None
        self.row(check, "ERROR", f"{failure['error'][:120]} at {failure['where']}")
        if first:
            self.failure = failure
            self.save()

    def earlier(self, section: str) -> dict:
        """The data an earlier section of this run recorded (empty if it did not run or record it)."""
        try:
            sections = json.loads(self.summary.read_text())["sections"]
        except (OSError, ValueError, KeyError):
            return {}
        return next((s["data"] for s in sections if s["name"] == section), {})

    def save(self) -> None:
        write_atomically(
            self.path, json.dumps({"rows": self.rows, "data": self.data, "failure": self.failure})
        )


class SectionEnded(Exception):
    """Raised by Report.check after a CUDA error: the rest of the section would fail the same way."""


def child(spec: dict) -> None:
    stacks = open(spec["stacks"], "w")  # noqa: SIM115 (kept open for faulthandler until the process ends)
    faulthandler.enable(stacks, all_threads=True)
    faulthandler.register(signal.SIGUSR1, stacks, all_threads=True)
    report = Report(Path(spec["result"]), Path(spec["summary"]), Path(spec["scratch"]), spec["quick"])
    report.save()
    try:
        module_spec = importlib.util.spec_from_file_location(
            f"gpu_section_{Path(spec['file']).stem}", spec["file"]
        )
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
        getattr(module, spec["function"])(report, *spec["args"])
    except SectionEnded:
        pass
    except Exception as exc:
        report.error(exc, spec["name"])
    report.save()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no interpreter teardown: after a CUDA error, freeing device memory can crash or hang


# ---- the first failing call ------------------------------------------------------------------------------


def traceback_frames(exc: BaseException) -> list[tuple[str, int, str]]:
    """(file, line, function) of exc's traceback, outermost first; qualified names where Python has them."""
    frames, tb = [], exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        frames.append((code.co_filename, tb.tb_lineno, getattr(code, "co_qualname", code.co_name)))
        tb = tb.tb_next
    return frames


def stack_frames(dump: str) -> list[tuple[str, int, str]]:
    """The frames of a faulthandler dump, outermost first: of the thread that ran repository code."""
    for block in re.split(r"\n\s*\n", dump):
        frames = [(f, int(n), fn) for f, n, fn in re.findall(r'File "([^"]+)", line (\d+) in (\S+)', block)]
        if any(_in_repo(f) for f, _, _ in frames):
            return frames[::-1]  # faulthandler lists the most recent call first
    return []


def first_failing_call(frames: list[tuple[str, int, str]]) -> dict:
    """where: the innermost frame of the repository's code; op: the first frame in minisarathi/ (the op the
    section called); caller: the section's frame that called it."""
    project = [f for f in frames if _in_repo(f[0])]
    library = [f for f in project if Path(f[0]).resolve().is_relative_to(LIBRARY)]
    if not project:
        return {"where": _frame(frames[-1]) if frames else "unknown"}
    failure = {"where": _frame(library[-1] if library else project[-1])}
    if library:
        failure["op"] = library[0][2]
        callers = [f for f in project[: project.index(library[0])] if f not in library]
        if callers:
            failure["caller"] = _frame(callers[-1])
    return failure


def _in_repo(file: str) -> bool:
    path = Path(file).resolve()
    return path.is_relative_to(REPO) and path != Path(__file__).resolve()


def _frame(frame: tuple[str, int, str]) -> str:
    file, line, function = frame
    path = Path(file).resolve()
    code = linecache.getline(file, line).strip()
    return f"{path.relative_to(REPO) if path.is_relative_to(REPO) else file}:{line} in {function}" + (
        f": {code[:100]}" if code else ""
    )


def describe(failure: dict | None) -> str:
    if not failure:
        return ""
    text = f"{failure.get('check', '')}: {failure['error']}" if failure.get("check") else failure["error"]
    if "where" in failure:
        text += f" at {failure['where']}"
    if "op" in failure:
        text += (
            f" (op {failure['op']}"
            + (f", called from {failure['caller']}" if "caller" in failure else "")
            + ")"
        )
    return text


# ---- in the runner's process -----------------------------------------------------------------------------


def run_sections(
    sections: list[Section], out: Path, budget_s: float, quick: bool = False, title: str = "gpu_check"
) -> list[Result]:
    """Every section in order, each in its own process under its limit (the --quick one with `quick`), as
    long as the budget lasts; summary.txt and summary.json in `out` after every section."""
    out.mkdir(parents=True, exist_ok=True)
    results = [Result(s, limit_s=s.quick_s if quick else s.limit_s) for s in sections]
    # An outer `timeout` sends SIGTERM: exit through the finally clauses, which kill the running section's
    # group.
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        _run_all(results, out, budget_s, quick, title)
    finally:
        signal.signal(signal.SIGTERM, previous)
    print("\n" + summary_text(results, title), flush=True)
    return results


def _run_all(results: list[Result], out: Path, budget_s: float, quick: bool, title: str) -> None:
    deadline = time.monotonic() + budget_s
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as scratch:
        write_summary(out, results, title)
        blocked = None
        for result in results:
            left = deadline - time.monotonic()
            if blocked:
                result.status = f"skipped: {blocked} failed"
            elif left < min(result.limit_s, 5):
                result.status = f"skipped: the {budget_s:.0f} s budget is spent"
            else:
                result.limit_s, result.status = min(result.limit_s, left), "running"
                write_summary(out, results, title)
                run_one(result, Path(scratch), out / "summary.json", quick)
                if result.section.required and result.failed:
                    blocked = result.section.name
            write_summary(out, results, title)


def run_one(result: Result, scratch: Path, summary: Path, quick: bool) -> None:
    section = result.section
    files = {kind: scratch / f"{section.name}.{kind}" for kind in ("result", "stacks")}
    spec = {
        "name": section.name,
        "file": inspect.getfile(section.fn),
        "function": section.fn.__name__,
        "args": list(section.args),
        "quick": quick,
        "summary": str(summary),
        "scratch": str(scratch),
        **{kind: str(path) for kind, path in files.items()},
    }
    print(f"==== {section.name} (limit {result.limit_s:.0f} s)", flush=True)
    start = time.monotonic()
    process = subprocess.Popen(
        [sys.executable, __file__, json.dumps(spec)],
        cwd=REPO,
        start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **section.env},
    )
    timed_out = False
    try:
        process.wait(timeout=result.limit_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        process.send_signal(signal.SIGUSR1)  # faulthandler: where it hangs
        for _ in range(int(DUMP_GRACE_S / 0.05)):
            time.sleep(0.05)
            if files["stacks"].stat().st_size:
                break
    finally:
        _kill_group(process.pid)
    process.wait()
    result.seconds = time.monotonic() - start
    saved = json.loads(files["result"].read_text()) if files["result"].exists() else {}
    result.rows = [tuple(row) for row in saved.get("rows", [])]
    result.data, result.failure = saved.get("data", {}), saved.get("failure")
    stacks = files["stacks"].read_text() if files["stacks"].exists() else ""
    if timed_out or process.returncode:
        how = (
            f"TIMEOUT after {result.limit_s:.0f} s"
            if timed_out
            else f"killed by {signal.Signals(-process.returncode).name}"
            if process.returncode < 0
            else f"exit code {process.returncode}"
        )
        result.status = "TIMEOUT" if timed_out else "CRASHED"
        result.failure = {
            "error": how + (f" (rows so far: {len(result.rows)})" if result.rows else ""),
            **first_failing_call(stack_frames(stacks)),
        }
        print(stacks, flush=True)
    elif any(row[1] == "ERROR" for row in result.rows):
        result.status = "ERROR"
    elif any(row[1] in FAILURES for row in result.rows):
        result.status = "FAILED"
    else:
        result.status = "ok"
    print(
        f"---- {section.name}: {result.status} in {result.seconds:.1f} s {describe(result.failure)}",
        flush=True,
    )


def _kill_group(pid: int) -> None:
    """The section's process and everything it started (sanitizer, rank processes), if still there."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def advice(results: list[Result]) -> str:
    """What the engine would be served with, given which sections failed."""
    failed = [r for r in results if r.failed]
    if results and results[0].section.required and results[0].status != "ok":
        return "nothing checked: " + describe(results[0].failure)
    unrun = [r.section.name for r in results if r.section.fallback and not r.failed and r.status != "ok"]
    wrong = [r.section.name for r in failed if r.section.fallback == CPU]
    flags = sorted({r.section.fallback for r in failed if r.section.fallback and r.section.fallback != CPU})
    if wrong:
        text = f"do not serve on device='cuda' ({', '.join(wrong)} failed): use {CPU}"
    elif flags:
        text = "serve with device='cuda', " + ", ".join(flags)
    else:
        text = "serve with the defaults: device='cuda' (CUDA graphs and overlap on)"
    if unrun:
        text += f"; not concluded: {', '.join(unrun)} did not run"
    others = [r.section.name for r in failed if not r.section.fallback]
    return text + (f"; failed without effect on serving: {', '.join(others)}" if others else "")


def summary_text(results: list[Result], title: str) -> str:
    lines = [
        title,
        "engine: " + advice(results),
        "",
        f"{'section':16s} {'status':>22s} {'seconds':>8s} {'limit':>6s}",
    ]
    for r in results:
        lines.append(f"{r.section.name:16s} {r.status:>22s} {r.seconds:8.1f} {r.limit_s:6.0f}")
        if r.failure:
            lines.append(f"    first failure: {describe(r.failure)}")
    rows = [row for r in results for row in r.rows]
    if rows:
        width = max(len(check) for check, _, _ in rows)
        lines += ["", *(f"{check:{width}s}  {result:>14s}  {detail}" for check, result, detail in rows)]
    return "\n".join(lines)


def write_summary(out: Path, results: list[Result], title: str) -> None:
    write_atomically(out / "summary.txt", summary_text(results, title) + "\n")
    write_atomically(
        out / "summary.json",
        json.dumps(
            {
                "title": title,
                "engine": advice(results),
                "sections": [
                    {
                        "name": r.section.name,
                        "stage": r.section.stage,
                        "status": r.status,
                        "seconds": round(r.seconds, 2),
                        "limit_s": r.limit_s,
                        "failure": r.failure,
                        "rows": r.rows,
                        "data": r.data,
                    }
                    for r in results
                ],
            },
            indent=1,
        ),
    )


def write_atomically(path: Path, text: str) -> None:
    """A kill mid-write leaves the previous version, never half a file."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)


def exit_code(results: list[Result]) -> int:
    """0: every section passed; 1: some failed; 2: the required first section failed (nothing ran)."""
    if results and results[0].section.required and results[0].status != "ok":
        return 2
    return int(any(r.failed for r in results))


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    child(json.loads(sys.argv[1]))
