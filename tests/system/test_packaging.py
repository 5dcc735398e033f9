"""A non-editable install must carry the kernels and the bundled model inside the wheel."""

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_wheel_ships_kernels_and_bundled_model(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(ROOT)],
        check=True,
        cwd=tmp_path,
    )
    (wheel,) = tmp_path.glob("minisarathi-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    kernels = {p.name for p in (ROOT / "cuda").iterdir() if p.suffix in (".cu", ".cuh")}
    assert kernels, "no kernel sources in cuda/"
    for k in kernels:
        assert f"minisarathi/cuda/{k}" in names
    for f in (ROOT / "models" / "stories260K").iterdir():
        assert f"minisarathi/models/stories260K/{f.name}" in names
    assert "minisarathi/backends/emulator/__init__.py" in names
    # the CPU backend's native kernels: built at run time
    sources = list((ROOT / "minisarathi" / "backends" / "cpu").glob("*.cpp"))
    assert sources, "no native kernel sources in minisarathi/backends/cpu/"
    for source in sources:
        assert f"minisarathi/backends/cpu/{source.name}" in names
