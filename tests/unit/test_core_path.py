"""The core path (docs/architecture.md, "The core path"): one msgpack request from the socket to the reference
backend and back. Its size stays within what a reader takes in an afternoon, and it reaches the accelerations
only through the hooks the doc lists. `python tests/unit/test_core_path.py` prints the measured size."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "minisarathi"

CORE_PATH = [
    "server/msgpack_door.py",  # framing, RPC methods, connections
    "server/protocol.py",  # messages, error codes, limits
    "server/hub.py",  # admission, keys and quotas, the request registry, delivery
    "server/engine_worker.py",  # the engine's thread
    "engine/engine.py",  # the synchronous step
    "engine/scheduler.py",  # the five policies under a token budget
    "engine/block_manager.py",  # KV blocks: free list, ref counts, prefix cache
    "engine/sequence.py",  # a request's state
    "batch.py",  # the batch contract
    "model/llama.py",  # the forward pass
    "model/loader.py",  # safetensors to weights
    "sampler.py",  # logits to tokens
    "backends/reference.py",  # the plain NumPy backend
]
MAX_FILES, MAX_LINES, MAX_CODE_LINES = 13, 4500, 3400

# Modules of the accelerations and of the other backends: a core file imports them only as its hook.
LAYERS = (
    "engine.overlap",
    "engine.slo_scheduler",
    "engine.tbt_slo",
    "engine.speculative",
    "engine.cost_model",
    "engine.profile",
    "model.decode_graphs",
    "parallel",
    "backends.cpu",
    "backends.cuda_ops",
    "backends.gpu_sampling",
    "backends.emulator",
    "server.http",
    "structured",
)
HOOKS = {
    "engine/engine.py": {
        "engine.overlap",
        "engine.slo_scheduler",
        "engine.speculative",
        "engine.cost_model",
        "engine.profile",
        "parallel.group",
        "backends.cpu.process_setup",
        "structured",
    },
    "model/llama.py": {"model.decode_graphs", "parallel.communicator"},
    "sampler.py": {"backends.cpu"},
    "server/engine_worker.py": {"backends.cpu.process_setup"},
}


def code_lines(path: Path) -> int:
    """Lines that are neither blank, nor comments, nor docstrings."""
    source = path.read_text()
    docstrings = set()
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if (
            isinstance(body, list)
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            docstrings.update(range(body[0].lineno, body[0].end_lineno + 1))
    return sum(
        1
        for n, line in enumerate(source.split("\n"), 1)
        if line.strip() and not line.strip().startswith("#") and n not in docstrings
    )


def package_imports(path: Path) -> set[str]:
    """The minisarathi modules a file imports, anywhere in it, without the package prefix."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = (
            [node.module]
            if isinstance(node, ast.ImportFrom) and node.module and node.module != "minisarathi"
            else [f"minisarathi.{a.name}" for a in node.names]  # from minisarathi import x: module x
            if isinstance(node, ast.ImportFrom) and node.module
            else [a.name for a in node.names]
            if isinstance(node, ast.Import)
            else []
        )
        found.update(n.removeprefix("minisarathi.") for n in names if n.startswith("minisarathi."))
    return found


def is_layer(module: str) -> bool:
    return any(module == layer or module.startswith(layer + ".") for layer in LAYERS)


def test_the_core_path_reads_in_an_afternoon():
    paths = [PACKAGE / f for f in CORE_PATH]
    lines = sum(len(p.read_text().splitlines()) for p in paths)
    code = sum(code_lines(p) for p in paths)
    assert len(paths) <= MAX_FILES and lines <= MAX_LINES and code <= MAX_CODE_LINES, (
        len(paths),
        lines,
        code,
    )


def test_the_core_reaches_the_accelerations_only_through_its_hooks():
    for name in CORE_PATH:
        layers = {m for m in package_imports(PACKAGE / name) if is_layer(m)}
        assert layers == HOOKS.get(name, set()), name


def test_every_hook_is_a_core_file_importing_a_layer():
    assert set(HOOKS) <= set(CORE_PATH) and all(is_layer(m) for hooks in HOOKS.values() for m in hooks)


def size(name: str) -> tuple[int, int]:
    path = PACKAGE / name
    return len(path.read_text().splitlines()), code_lines(path)


if __name__ == "__main__":
    sizes = {name: size(name) for name in CORE_PATH}
    for name, (lines, code) in sizes.items():
        print(f"{name:28} {lines:5} lines {code:5} of code")
    lines, code = (sum(s[i] for s in sizes.values()) for i in (0, 1))
    print(f"{len(CORE_PATH)} files {lines:5} lines {code:5} of code")
