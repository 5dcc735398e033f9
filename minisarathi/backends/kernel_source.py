"""Compile-time constants of the kernel sources, read by the host so that each is written once."""

from __future__ import annotations

import re

from minisarathi.paths import cuda_dir


def kernel_constants(file: str) -> dict[str, int]:
    """The `constexpr int NAME = expression;` lines of a kernel file, evaluated in order. The host reads a
    kernel's compile-time constants (block size, tile limits) from its source, so each is written once."""
    constants: dict[str, int] = {}
    for name, expression in re.findall(
        r"^constexpr int (\w+) = ([\w\s*/+()-]+);", (cuda_dir() / file).read_text(), flags=re.MULTILINE
    ):
        constants[name] = int(
            eval(expression, {"__builtins__": {}}, dict(constants))
        )  # our own integer expressions
    return constants
