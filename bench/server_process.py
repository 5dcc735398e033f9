"""A `minisarathi serve` child process for the reliability benchmarks, and what it holds (RSS, open fds)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass


@dataclass
class Served:
    proc: subprocess.Popen
    port: int
    log_path: str

    def rss_mb(self) -> float:
        with open(f"/proc/{self.proc.pid}/status") as f:
            kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        return kb / 1024

    def open_fds(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))


@contextlib.contextmanager
def serving(*args: str):
    """`minisarathi serve --port 0 ARGS` until the block ends (SIGTERM, then wait)."""
    with tempfile.TemporaryDirectory() as tmp:
        log_path = os.path.join(tmp, "server.log")
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "minisarathi",
                    "serve",
                    "--port",
                    "0",
                    "--log-level",
                    "WARNING",
                    *args,
                ],
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
            )
        try:
            line = proc.stdout.readline()
            match = re.match(r"minisarathi serving on [\d.]+:(\d+)", line)
            if match is None:
                raise RuntimeError("server did not start:\n" + open(log_path).read())
            yield Served(proc, int(match.group(1)), log_path)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=120)
