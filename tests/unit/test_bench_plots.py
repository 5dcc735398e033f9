"""Plots are optional: without matplotlib the bench says so and carries on."""

import sys

from minisarathi.bench.metrics import BatchRecord, RequestRecord
from minisarathi.bench.plots import plot_comparison

RUNS = {
    "sarathi-64": (
        [RequestRecord("a", 4, 0.0, [0.1, 0.2, 0.35], 0.0, 0.35)],
        [BatchRecord(0.0, 1, 4, 0, 0.1)],
    )
}


def test_without_matplotlib_plots_are_skipped(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    assert plot_comparison(RUNS, {"sarathi-64": 1.5}, tmp_path) == []
    assert "plots skipped" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
