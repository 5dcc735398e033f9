"""Where the kernel sources and the bundled model are, in a source checkout and in an installed wheel."""

from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent


def _data_dir(name: str) -> Path:
    # Installed wheel: minisarathi/<name>. Source checkout: <repo>/<name> beside the package.
    for candidate in (_PACKAGE / name, _PACKAGE.parent / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"cannot find the {name!r} folder next to {_PACKAGE}")


def cuda_dir() -> Path:
    return _data_dir("cuda")


def default_model_dir() -> Path:
    return _data_dir("models") / "stories260K"
