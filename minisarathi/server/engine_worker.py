"""The engine's own thread: every engine call runs on it, in order, between steps.

The engine is not thread-safe and a step can take long (a 512-token prefill chunk), so it runs on its own
thread that loops step() while there is work and takes adds/aborts/stats from an inbox between steps. Its
outputs come back to the event loop with call_soon_threadsafe, so the loop stays free to answer health checks
or accept connections while a step runs.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading

from minisarathi.backends.cpu.process_setup import release_free_memory

log = logging.getLogger("minisarathi.server")

IDLE_RELEASE_S = 1.0  # idle this long, the engine thread gives back the memory kept free for steps


class EngineWorker:
    """Owns the engine: every engine call happens on this thread, in inbox order, between steps."""

    def __init__(self, engine, loop: asyncio.AbstractEventLoop, on_outputs, on_step_error):
        self.engine = engine
        self._loop = loop
        self._on_outputs = on_outputs  # called on the loop with list[RequestOutput]
        self._on_step_error = on_step_error  # called on the loop with the exception
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # callables, or None to stop
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)

    def start(self):
        self._thread.start()

    def stop(self):
        self._inbox.put(None)
        self._thread.join()

    def post(self, fn):
        """Run fn() on the engine thread; errors are logged."""
        self._inbox.put(fn)

    def post_unless_error(self, fn, on_error):
        """Run fn() on the engine thread; only if it raises, on_error(exception) is called on the loop. Unlike
        call(), success costs the loop nothing: no wake-up (the engine thread's write to the loop's self-pipe,
        which also hands the GIL over between the two threads) and no callback."""

        def run():
            try:
                fn()
            except Exception as e:  # delivered to the caller, who decides what it means
                self._loop.call_soon_threadsafe(on_error, e)

        self._inbox.put(run)

    def call(self, fn) -> asyncio.Future:
        """Run fn() on the engine thread; the future (on the loop) gets its result or exception."""
        future = self._loop.create_future()

        def run():
            try:
                result, error = fn(), None
            except Exception as e:  # delivered to the caller, who decides what it means
                result, error = None, e
            self._loop.call_soon_threadsafe(_settle, future, result, error)

        self._inbox.put(run)
        return future

    def _next_command_when_idle(self):
        """The next command; if none comes within IDLE_RELEASE_S, the memory glibc keeps free for steps is
        given back first (process_setup.release_free_memory): an idle server's RSS is then what it holds, not
        its highest peak so far. Back-to-back requests keep the kept memory, and with it steps free of page
        faults."""
        try:
            return self._inbox.get(timeout=IDLE_RELEASE_S)
        except queue.Empty:
            release_free_memory()
            return self._inbox.get()

    def _run(self):
        while True:
            # Block only when idle (or every request is paused); while requests run, take whatever arrived
            # since the last step.
            commands = [] if self.engine.has_work() else [self._next_command_when_idle()]
            while True:
                try:
                    commands.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
            for command in commands:
                if command is None:
                    return
                try:
                    command()
                except Exception:
                    log.exception("engine command failed")
            if self.engine.has_work():
                try:
                    steps = len(self.engine.step_records)
                    outputs = self.engine.step()
                    if log.isEnabledFor(logging.DEBUG) and len(self.engine.step_records) > steps:
                        _log_step(self.engine)
                except Exception as e:
                    log.exception("engine step failed")
                    self._loop.call_soon_threadsafe(self._on_step_error, e)
                    continue
                if outputs:
                    self._loop.call_soon_threadsafe(self._on_outputs, outputs)


def _log_step(engine) -> None:
    step = engine.step_records[-1]
    log.debug(
        "step",
        extra={
            "fields": {
                "decodes": step.num_decode_tokens,
                "prefill_tokens": step.num_prefill_tokens,
                "preempted": step.num_preempted,
                "kv_blocks_free": engine.block_manager.num_free_blocks,
                "step_s": round(step.step_time, 6),
            }
        },
    )


def _settle(future: asyncio.Future, result, error):
    if future.done():
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)
