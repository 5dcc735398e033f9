"""Python-level operations and NumPy array allocations of one engine step, per layer and outside the layers.

    python -m bench.op_calls                                    # the bundled stories260K
    python -m bench.op_calls /work/peers/models/tiny /work/peers/models/small

At small models every NumPy call costs about as much as its arithmetic, so what a step costs is close to
how many calls it makes. This counts, for a decode step (32 sequences decoding) and a hybrid step (31 decodes
and a 128-token prefill chunk) of the engine:

- operations: the bytecode instructions executed in minisarathi's own code that dispatch to other code: calls,
  operators, subscripts and subscript stores, comparisons (opcode tracing, sys.settrace). Each NumPy call the
  code makes is one of them (an operator or a slice on an array is a NumPy call too); so are the few on plain
  Python numbers. What NumPy's own Python wrappers (np.take, np.tile, ...) do inside is not counted;
- allocations: NumPy array buffers allocated (views allocate none; a Python scalar combined with an array
  allocates a 0-d one), counted by a NumPy memory handler (PyDataMem_SetHandler) installed while the step runs.

Each is split into: the engine (schedule, batch, sampling, update), the forward outside its layers
(embedding, final norm, lm_head), the first layer (which also builds what every layer shares: RoPE tables,
the attention plan) and each later layer (their mean), and per backend op within a layer. Prints one JSON
line per model and step, then a table. Counts, not times: tracing makes the step slow, and the counts do
not depend on the machine.
"""
from __future__ import annotations

import argparse
import ast
import ctypes
import dis
import inspect
import json
import sys
import textwrap
from collections import Counter
from pathlib import Path

import numpy as np
from numpy._core import _multiarray_umath

import minisarathi
from minisarathi import SamplingParams
from minisarathi.engine.engine import LLMEngine
from minisarathi.model.llama import LlamaModel

PACKAGE_DIR = str(Path(minisarathi.__file__).parent)
# Instructions that hand work to other code (CPython 3.11 names; 3.12 folds some of them, see _kinds()).
DISPATCHING = {"CALL", "CALL_FUNCTION_EX", "BINARY_OP", "BINARY_SUBSCR", "STORE_SUBSCR", "DELETE_SUBSCR",
               "COMPARE_OP", "UNARY_NEGATIVE", "UNARY_INVERT", "UNARY_NOT", "BINARY_SLICE", "STORE_SLICE"}
NUM_DECODES, PROMPT_LEN = 32, 128


# NumPy's PyDataMemAllocator and PyDataMem_Handler (numpy/ndarraytypes.h), version 1.
MALLOC = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
CALLOC = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t)
REALLOC = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
FREE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)


class DataMemAllocator(ctypes.Structure):
    _fields_ = [("ctx", ctypes.c_void_p), ("malloc", MALLOC), ("calloc", CALLOC), ("realloc", REALLOC),
                ("free", FREE)]


class DataMemHandler(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char * 127), ("version", ctypes.c_uint8), ("allocator", DataMemAllocator)]


class AllocationCounter:
    """Counts NumPy's array buffer allocations while installed, through NumPy's memory-handler API: ctypes
    callbacks that count and call libc."""

    def __init__(self, on_allocation):
        libc = ctypes.CDLL(None)
        malloc, calloc, realloc, free = libc.malloc, libc.calloc, libc.realloc, libc.free
        malloc.restype = calloc.restype = realloc.restype = ctypes.c_void_p
        malloc.argtypes, calloc.argtypes = [ctypes.c_size_t], [ctypes.c_size_t, ctypes.c_size_t]
        realloc.argtypes, free.argtypes = [ctypes.c_void_p, ctypes.c_size_t], [ctypes.c_void_p]

        def counted(fn):
            def allocate(_ctx, *args):
                on_allocation()
                return fn(*args)
            return allocate

        functions = (MALLOC(counted(malloc)), CALLOC(counted(calloc)), REALLOC(counted(realloc)),
                     FREE(lambda _ctx, pointer, _size: free(pointer)))
        self._handler = DataMemHandler(b"op_calls counter", 1, DataMemAllocator(None, *functions))
        new_capsule = ctypes.pythonapi.PyCapsule_New
        new_capsule.restype, new_capsule.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
        self._capsule = new_capsule(ctypes.addressof(self._handler), b"mem_handler", None)
        get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
        get_pointer.restype, get_pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
        api = ctypes.cast(get_pointer(_multiarray_umath._ARRAY_API, None), ctypes.POINTER(ctypes.c_void_p))
        self._set_handler = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.py_object)(api[304])  # PyDataMem_SetHandler
        # Arrays allocated through the handler free through it whenever they die, even at interpreter exit:
        # its callbacks must outlive them, so they are never released.
        for obj in (functions, self._handler, self._capsule):
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))

    def __enter__(self):
        self._previous = self._set_handler(self._capsule)
        return self

    def __exit__(self, *exc):
        self._set_handler(self._previous)


def _loop_lines(function) -> range:
    """The line numbers of the layer loop (the first `for` statement) of function's source."""
    lines, first = inspect.getsourcelines(function)
    loop = next(node for node in ast.walk(ast.parse(textwrap.dedent("".join(lines))))
                if isinstance(node, ast.For))
    return range(first - 1 + loop.lineno, first + loop.end_lineno)


class StepCounter:
    """Counts operations and allocations by (section, op) over one engine step (see the module docstring)."""

    def __init__(self):
        self.operations: Counter = Counter()
        self.allocations: Counter = Counter()
        self._kinds: dict = {}             # code object -> {instruction offset: opname} of dispatching ones
        self._loop = _loop_lines(LlamaModel.run)
        self._run_frame = self._op_frame = None
        self._layer = -1
        self._op = "model"
        self._allocation_counter = AllocationCounter(self._count_allocation)

    def section(self) -> tuple[str, str]:
        if self._run_frame is None:
            return "engine", "engine"
        if self._run_frame.f_lineno in self._loop and self._layer >= 0:
            return ("first layer" if self._layer == 0 else "later layers"), self._op
        return "outside layers", self._op

    def _count_allocation(self):
        self.allocations[self.section()] += 1

    def _kinds_of(self, code) -> dict:
        kinds = self._kinds.get(code)
        if kinds is None:
            kinds = self._kinds[code] = {i.offset: i.opname for i in dis.get_instructions(code)
                                         if i.opname in DISPATCHING}
        return kinds

    def _trace_call(self, frame, event, arg):
        code = frame.f_code
        if not code.co_filename.startswith(PACKAGE_DIR):
            return None
        if code is LlamaModel.run.__code__:
            self._run_frame, self._layer = frame, -1
        elif self._run_frame is not None and frame.f_back is self._run_frame:
            self._op_frame, self._op = frame, code.co_name
        frame.f_trace_opcodes = True
        return self._trace_local

    def _trace_local(self, frame, event, arg):
        if event == "opcode":
            if frame.f_lasti in self._kinds_of(frame.f_code):
                self.operations[self.section()] += 1
        elif event == "line":
            if frame is self._run_frame and frame.f_lineno == self._loop.start:
                self._layer += 1
        elif event == "return":
            if frame is self._op_frame:
                self._op_frame, self._op = None, "model"
            elif frame is self._run_frame:
                self._run_frame = None
        return self._trace_local

    def step(self, engine: LLMEngine) -> None:
        sys.settrace(self._trace_call)
        try:
            with self._allocation_counter:
                engine.step()
        finally:
            sys.settrace(None)


def summary(counts: Counter, num_layers: int) -> dict:
    """Totals by section (later layers: their mean) and the per-op split of the first and later layers."""
    later = max(1, num_layers - 1)
    by_section = Counter()
    per_op = {"first layer": Counter(), "later layers": Counter()}
    for (section, op), n in counts.items():
        by_section[section] += n
        if section in per_op:
            per_op[section][op] += n
    return {"step": sum(counts.values()),
            "engine": by_section["engine"], "outside layers": by_section["outside layers"],
            "first layer": by_section["first layer"],
            "later layer": round(by_section["later layers"] / later, 1),
            "first layer by op": dict(per_op["first layer"].most_common()),
            "later layer by op": {op: round(n / later, 1) for op, n in per_op["later layers"].most_common()}}


def count_steps(model_path: str | None) -> list[dict]:
    engine = LLMEngine(model_path, blas_threads=1)
    params = SamplingParams(max_tokens=256, temperature=0.0, ignore_eos=True)
    rng = np.random.default_rng(0)
    vocab = engine.model_config.vocab_size

    def add(n):
        for _ in range(n):
            engine.add_request(str(len(engine.requests)), rng.integers(3, vocab, PROMPT_LEN).tolist(), params)

    def decoding():   # every request has sampled its first token
        return all(seq.output_token_ids for seq in engine.requests.values())

    add(NUM_DECODES - 1)
    while not decoding():
        engine.step()
    engine.step()
    rows = []
    for name in ("hybrid", "decode"):
        if name == "hybrid":
            add(1)                                   # its 128-token chunk joins the 31 decodes in one step
        else:
            while not decoding():
                engine.step()
            engine.step()                            # buffers grown for this batch
        counter = StepCounter()
        counter.step(engine)
        num_layers = engine.model_config.num_hidden_layers
        rows.append({"bench": "op_calls", "model": model_path or "stories260K", "step": name,
                     "layers": num_layers, "operations": summary(counter.operations, num_layers),
                     "allocations": summary(counter.allocations, num_layers)})
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="*", default=[None], help="HF folders (default: the bundled stories260K)")
    args = parser.parse_args()
    rows = []
    for model in args.models:
        for row in count_steps(model):
            print(json.dumps(row), flush=True)
            rows.append(row)
    print(f"\n{'model':28} {'step':6} {'what':11} {'step':>6} {'engine':>6} {'outside':>7} {'layer 0':>7} "
          f"{'layer':>6}")
    for r in rows:
        for what in ("operations", "allocations"):
            s = r[what]
            print(f"{Path(r['model']).name:28} {r['step']:6} {what:11} {s['step']:6d} {s['engine']:6d} "
                  f"{s['outside layers']:7d} {s['first layer']:7d} {s['later layer']:6.1f}")
    for r in rows:
        print(f"\n{Path(r['model']).name} {r['step']}, a later layer by op (operations / allocations): " + ", ".join(
            f"{op} {n} / {r['allocations']['later layer by op'].get(op, 0)}"
            for op, n in r["operations"]["later layer by op"].items()))


if __name__ == "__main__":
    main()
