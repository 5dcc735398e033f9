"""The code's format and lint rules (pyproject.toml's [tool.ruff]): ruff format and ruff check both pass."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PATHS = ["minisarathi", "tests", "bench"]


def ruff(*args: str) -> subprocess.CompletedProcess:
    try:
        import ruff  # noqa: F401
    except ImportError:
        pytest.fail('ruff is not installed: pip install -e ".[test]"')
    return subprocess.run(
        [sys.executable, "-m", "ruff", *args, *PATHS], cwd=ROOT, capture_output=True, text=True
    )


def test_the_code_is_formatted():
    done = ruff("format", "--check", "--diff")
    assert done.returncode == 0, f"run `ruff format {' '.join(PATHS)}`:\n{done.stdout[-4000:]}{done.stderr}"


def test_the_code_passes_the_linter():
    done = ruff("check", "--output-format", "concise")
    assert done.returncode == 0, f"`ruff check {' '.join(PATHS)}`:\n{done.stdout[-4000:]}{done.stderr}"
