"""NumpyOps.zeros (the KV cache's memory): zeros, and resident from the start, not mapped on first write."""
import subprocess
import sys
from pathlib import Path

import pytest

# In a fresh interpreter: in this one, memory that earlier tests freed may be reused already resident.
MEASURE = """
import os
import numpy as np
from minisarathi.backends.numpy_ops import NumpyOps

def resident_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

before = resident_bytes()
cache = NumpyOps().zeros((1024, 4, 16, 256))      # float32, 64 MiB
grown = resident_bytes() - before
assert cache.dtype == np.float32 and cache.nbytes == 64 << 20 and not cache.any()
print(grown)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_zeros_are_resident_at_once():
    done = subprocess.run([sys.executable, "-c", MEASURE], cwd=Path(__file__).resolve().parent.parent,
                          capture_output=True, text=True, check=True)
    grown = int(done.stdout)
    assert grown >= 0.9 * (64 << 20), f"only {grown >> 20} MiB of the 64 MiB cache became resident"
