"""A one-line progress display on stderr (no tqdm): redrawn at most twice a second, only on a terminal."""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, label: str, total: int):
        self.label, self.total, self.stream = label, total, sys.stderr
        self.enabled = self.stream.isatty()
        self.start = time.monotonic()
        self.last_draw = 0.0

    def update(self, done: int, running: int) -> None:
        now = time.monotonic()
        if not self.enabled or now - self.last_draw < 0.5:
            return
        self.last_draw = now
        width = 24
        filled = width * done // max(self.total, 1)
        self.stream.write(
            f"\r[{self.label}] [{'#' * filled}{'.' * (width - filled)}] {done}/{self.total} done, "
            f"{running} in flight, {now - self.start:6.1f} s "
        )
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.last_draw:
            self.stream.write("\n")
            self.stream.flush()
