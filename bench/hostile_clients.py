"""Greedy and unauthenticated clients against a bystander: its latency, the server's memory, the KV pool.

    python -m bench.hostile_clients                      # every scenario (docs/reliability.md)
    python -m bench.hostile_clients --scenarios unread_streams,unauthenticated_flood --samples 20
    python -m bench.hostile_clients --engine-only        # the engine's step time alone, no server (see below)
    python -m bench.hostile_clients --scenarios brute_force,slowloris --accept-rate 20   # with the server's
                                                          # --accept-rate-per-address 20

A server with an API key runs the bundled model. A bystander (with the key) times back-to-back greedy
24-token generates: first alone (idle), then while each attacker runs:

  stop_lists              one client (connection) keeping 8 generates in flight with maximal legal stop lists
                          (16 strings of 64 characters, each starting with a space) and 64 stop token ids
                          (common ones: a request ends soon after min_tokens), min_tokens 100 of max_tokens
                          128 (stop ids masked until then)
  same_load_without_stops the same 8 generates without stop lists: what the load alone costs the bystander
  same_load_streamed      the same 8 again, streamed: each of their tokens a chunk the server sends
  tokenize                4 connections calling maximal tokenize (256 KiB) and detokenize (65536 ids)
  unread_streams          256 streamed 500-token generates whose client never reads
  unauthenticated_flood   1000 connections without the key, each trickling an auth message at 1 byte/s;
                          while they are open, 20 fresh key holders connect one after another (they must
                          all get in)
  connection_bursts       10 bursts of 1000 connections (auth, health, close): server RSS after each
  brute_force             wrong keys from another address (127.0.0.2): a new msgpack connection per guess, and
                          50 HTTP guessers in parallel, each a new connection per guess; guesses per second
                          after the 5th failure (the target: <= 20)
  slowloris               --stalled (1100) connections from 127.0.0.2, half on each door, reopened as the
                          server closes them: silent, half a header, a body that never ends (HTTP); with
                          --tls, stalled handshakes (silent, or a record header and no ClientHello). The
                          server has 1024 file descriptors. Meanwhile 20 fresh key holders on each door must
                          be served
  multi_prompt            one /v1/completions request of 1,020 prompts after another from a key with rpm 1,
                          concurrent 1: the statuses it gets
  hostile_template        chat requests that make the server's chat template (HOSTILE_TEMPLATE) run a nested
                          range loop, lipsum(50000) or a 10**8-character string, in turn: the statuses

The server has a keys file (the bystander's key, and a small one: rpm 1, concurrent 1), the HTTP door and
HOSTILE_TEMPLATE as its chat template (only the hostile_template scenario's messages make it do harm). In
each of the last four scenarios a key holder's 300-token stream runs beside the attack: lost_streams 1 if it
did not get every token. p99_over_idle_p99 compares the bystander's P99 with its idle one (the target: <= 3).
loop_cpu_share: the cores the server's event-loop thread used while the bystander ran beside the attack.

After each scenario the server must return to no request held and every KV block free. One JSON line per
scenario: bystander p50/p99 (ms) and p99 over the idle p50 measured just before the attack (the machine is
shared: its load drifts), plus what the scenario checks. Each attack runs in a process of its own.
server_steps: the server's step times (ms; `stats` with steps_since) while the bystander ran alone just before
the attack, and during it: percentiles, the median decode step by number of sequences, the median prefill step
([count, median ms]). With a steady attack the decode steps with fewer sequences than most and the prefill
steps are those where its requests finish and their replacements arrive.

--engine-only: no server, no clients; the engine `serve` builds, in this process, stepped back to back: the
bystander's generate alone, then beside 8 and 32 of the stop_lists or same_load_without_stops generates (with
the params the server builds from them: temperature 1, sampled), each finished request replaced at once (as
the attackers keep theirs in flight). One JSON line per batch: the median and p90 step time, the median time
in the sampler, and the median step over the bystander-alone one; --clock cpu times the thread's CPU instead
of the wall; --parts adds the median time per step of the engine's phases and of the forward's backend ops;
--rounds N runs every batch N times over, in turn, and shows the round with the smallest median step.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import itertools
import json
import multiprocessing
import os
import resource
import socket
import ssl
import tempfile
import threading
import time
from dataclasses import dataclass

import msgpack
import numpy as np

from bench.server_process import serving
from minisarathi.cli_args import engine_options_from_args
from minisarathi.client import Client, RPCError
from minisarathi.engine.engine import LLMEngine
from minisarathi.sampling_params import SamplingParams
from minisarathi.server.auth import hash_secret
from minisarathi.server.cli import add_serve_arguments

KEY = "bench-hostile-clients-key"
SMALL_KEY = "bench-hostile-clients-small-key"  # rpm 1, concurrent 1
MODEL = "stories260K"
ATTACKER = "127.0.0.2"  # attacks that earn a per-address backoff come from here, not the bystander's address
STALLED = 1100  # slowloris: more connections than the server's file-descriptor limit (FD_LIMIT)
FD_LIMIT = 1024
# A chat template a model could ship: what it runs depends on the last message (hostile_template).
HOSTILE_TEMPLATE = """{%- set c = messages[-1]['content'] -%}
{%- if c == 'range_loop' -%}
{%- for i in range(100000) -%}{%- for j in range(100000) -%}{%- endfor -%}{%- endfor -%}
{%- elif c == 'lipsum' -%}{{ lipsum(50000) }}
{%- elif c == 'huge_string' -%}{{ 'a' * 10**8 }}
{%- else -%}{%- for m in messages -%}{{ m['content'] }}{%- endfor -%}{%- endif -%}"""
# each scenario of docs/reliability.md's issue-26 table; --tls runs those marked so over TLS
SCENARIOS = (
    "stop_lists",
    "same_load_without_stops",
    "same_load_streamed",
    "tokenize",
    "unread_streams",
    "unauthenticated_flood",
    "connection_bursts",
    "brute_force",
    "slowloris",
    "multi_prompt",
    "hostile_template",
)
TLS_SCENARIOS = ("brute_force", "slowloris")
# these also run a key holder's stream beside the attack (lost_streams)
STREAM_BESIDE = ("brute_force", "slowloris", "multi_prompt", "hostile_template")


@dataclass(frozen=True)
class Target:
    """The server under attack (its msgpack and HTTP ports, the CA file of its TLS certificate with --tls),
    and the size of the slowloris attack."""

    port: int
    http_port: int
    tls_ca: str | None = None
    stalled: int = STALLED  # slowloris's connections

    def tls(self) -> ssl.SSLContext | None:
        return None if self.tls_ca is None else ssl.create_default_context(cafile=self.tls_ca)

    def client(self, key: str = KEY, timeout: float = 60) -> Client:
        return Client("127.0.0.1", self.port, api_key=key, timeout=timeout, tls=self.tls())


def bystander(target: Target, samples: int) -> list[float]:
    latencies = []
    with target.client(timeout=600) as c:
        for _ in range(samples):
            start = time.perf_counter()
            result = c.generate("Once upon a time", max_tokens=24, temperature=0, ignore_eos=True)
            latencies.append(time.perf_counter() - start)
            assert result.completion_tokens == 24
    return latencies


async def _connect(port: int, key: bool = True):
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    if key:
        writer.write(msgpack.packb([0, 0, "auth", [KEY]]))
    return reader, writer


async def _pump(reader, writer, calls: list[tuple[str, list]], in_flight: int, stop) -> tuple[int, int]:
    """Keep `in_flight` of the calls (method, params; in turn) outstanding, each with its own msgid, reading
    every answer. Returns (answered, of them errors)."""
    unpacker = msgpack.Unpacker()
    sent = answered = errors = 0
    while not stop.is_set():
        while sent - answered < in_flight:
            method, params = calls[sent % len(calls)]
            sent += 1  # msgid 0 is the auth's
            writer.write(msgpack.packb([0, sent, method, params]))
        data = await reader.read(1 << 16)
        if not data:
            break
        unpacker.feed(data)
        for message in unpacker:
            if message[0] == 1 and message[1] != 0:
                answered += 1
                errors += message[2] is not None
    return answered, errors


async def _pumps(port: int, calls, connections: int, in_flight: int, stop) -> dict:
    conns = [await _connect(port) for _ in range(connections)]
    counts = await asyncio.gather(*(_pump(r, w, calls, in_flight, stop) for r, w in conns))
    return {"attack_calls_answered": sum(a for a, _ in counts), "attack_errors": sum(e for _, e in counts)}


def _greedy_generate(stop_lists: bool) -> dict:
    rng = np.random.default_rng(0)
    # Each starts with a space, the commonest character of the text, so every token's text has places where
    # all 16 could start and is searched for them (stops of rare characters are skipped per token).
    stops = [" " + "".join(chr(c) for c in rng.integers(ord("a"), ord("z") + 1, 63)) for _ in range(16)]
    params = {"prompt": "Once upon a time", "max_tokens": 128, "min_tokens": 100}
    return {**params, "stop": stops, "stop_token_ids": list(range(400, 464))} if stop_lists else params


async def stop_lists(target, stop) -> dict:
    return await _pumps(target.port, [("generate", [_greedy_generate(True)])], 1, 8, stop)


async def same_load_without_stops(target, stop) -> dict:
    return await _pumps(target.port, [("generate", [_greedy_generate(False)])], 1, 8, stop)


async def same_load_streamed(target, stop) -> dict:
    return await _pumps(
        target.port, [("generate", [{**_greedy_generate(False), "stream": True}])], 1, 8, stop
    )


async def tokenize(target, stop) -> dict:
    text = ("Once upon a time there was a big red ball. " * 6000)[: 256 << 10]
    return await _pumps(target.port, [("tokenize", [text]), ("detokenize", [[400] * 65536])], 4, 2, stop)


async def unread_streams(target, stop):
    socks = []
    for c in range(2):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", target.port))
        sock.sendall(
            msgpack.packb([0, 0, "auth", [KEY]])
            + b"".join(
                msgpack.packb(
                    [
                        0,
                        i,
                        "generate",
                        [
                            {
                                "prompt": "Once upon a time",
                                "max_tokens": 500,
                                "ignore_eos": True,
                                "stream": True,
                            }
                        ],
                    ]
                )
                for i in range(1, 129)
            )
        )
        socks.append(sock)
    while not stop.is_set():
        await asyncio.sleep(0.1)
    for sock in socks:
        sock.close()


async def unauthenticated_flood(target, stop) -> dict:
    message = msgpack.packb([0, 1, "auth", ["x" * 64]])
    closed = 0

    async def trickler():
        nonlocal closed
        while not stop.is_set():
            try:
                reader, writer = await _connect(target.port, key=False)
                for byte in message:
                    if stop.is_set():
                        break
                    writer.write(bytes([byte]))
                    await writer.drain()
                    await asyncio.sleep(1.0)
                writer.close()
            except (ConnectionError, OSError):
                closed += 1
                await asyncio.sleep(1.0)

    tasks = [asyncio.ensure_future(trickler()) for _ in range(1000)]

    while not stop.is_set():
        await asyncio.sleep(0.2)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return {"flood_connections_closed_by_server": closed}


async def connection_bursts(port, bursts: int, per_burst: int, rss) -> tuple[list[float], list[int]]:
    """RSS after each burst, and per burst the connections that were not served (reset or closed early)."""
    levels, unserved = [], []
    for _ in range(bursts):

        async def one() -> bool:
            try:
                reader, writer = await _connect(port)
                writer.write(msgpack.packb([0, 1, "health", []]))
                unpacker = msgpack.Unpacker()
                answered = 0
                while answered < 2 and (data := await reader.read(1 << 16)):
                    unpacker.feed(data)
                    answered += sum(1 for _ in unpacker)
                writer.close()
                return answered == 2
            except (ConnectionError, OSError):
                return False

        served = await asyncio.gather(*(one() for _ in range(per_burst)))
        unserved.append(served.count(False))
        await asyncio.sleep(0.5)
        levels.append(round(rss(), 1))
    return levels, unserved


async def _open(target: Target, port: int, source: str = "127.0.0.1"):
    return await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0), ssl=target.tls())


async def _http_status(target: Target, head: bytes, body: bytes = b"", source: str = ATTACKER) -> int | None:
    """One request on a connection of its own: its status, None if the server closed first."""
    reader, writer = await _open(target, target.http_port, source)
    try:
        writer.write(head + b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body)
        line = await reader.readline()
        return int(line.split()[1]) if line.startswith(b"HTTP/") else None
    except (ConnectionError, OSError):
        return None
    finally:
        writer.close()


async def brute_force(target, stop) -> dict:
    """Wrong keys from ATTACKER: one new msgpack connection per guess, and 50 HTTP guessers in parallel each
    on a new connection per guess. Guesses per second after the 5th failure (the target: <= 20)."""
    checked: list[float] = []  # when each wrong key was answered as wrong
    refused = 0  # attempts the server turned away unchecked (its address queued too many)

    async def msgpack_guesser():
        nonlocal refused
        while not stop.is_set():
            try:
                reader, writer = await _open(target, target.port, ATTACKER)
                writer.write(msgpack.packb([0, 0, "auth", [f"guess-{len(checked)}"]]))
                answer = msgpack.unpackb(await reader.read(1 << 16))
                writer.close()
            except (ConnectionError, OSError, ValueError):
                continue
            if answer[0] == 1:
                checked.append(time.monotonic())
            else:  # the notification of an attempt refused unchecked
                refused += 1

    async def http_guesser(i: int):
        nonlocal refused
        while not stop.is_set():
            head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer guess-%d\r\n" % i
            status = await _http_status(target, head, b"{}")
            if status == 401:
                checked.append(time.monotonic())
            elif status == 429:
                refused += 1

    tasks = [asyncio.ensure_future(msgpack_guesser())] + [
        asyncio.ensure_future(http_guesser(i)) for i in range(50)
    ]
    while not stop.is_set():
        await asyncio.sleep(0.1)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    checked.sort()
    after_5th = checked[5:]
    rate = (len(after_5th) - 1) / (after_5th[-1] - after_5th[0]) if len(after_5th) > 1 else 0.0
    return {"guesses": len(checked), "guesses_per_s_after_5th_failure": round(rate, 2), "refused": refused}


async def slowloris(target, stop) -> dict:
    """`--stalled` connections from ATTACKER, half on each door, each reopened as soon as the server closes
    it: ones that send nothing, half a header, a body that never ends (with the small key, so that it passes
    auth); under --tls, handshakes that stall: half send nothing, half a TLS record header announcing a
    ClientHello that never comes."""
    closed = 0
    small = SMALL_KEY.encode()
    stalls = (
        b"",
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le",
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
        + small
        + b"\r\nContent-Length: 100000\r\n\r\n{",
    )
    tls_stalls = (b"", b"\x16\x03\x01\x02\x00")  # a handshake record of 512 bytes, none of them sent

    async def staller(i: int):
        nonlocal closed
        port = target.http_port if i % 2 else target.port
        if target.tls_ca is not None:  # plain TCP to the TLS port: the handshake is the attack's
            stall = tls_stalls[i // 2 % len(tls_stalls)]
        else:
            stall = stalls[i // 2 % len(stalls)] if port == target.http_port else b""
        while not stop.is_set():
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(ATTACKER, 0))
                writer.write(stall)
                await reader.read()  # until the server closes it
                writer.close()
            except (ConnectionError, OSError):
                await asyncio.sleep(0.1)
            closed += 1

    tasks = [asyncio.ensure_future(staller(i)) for i in range(target.stalled)]
    while not stop.is_set():
        await asyncio.sleep(0.2)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return {"stalled_connections": target.stalled, "closed_by_server": closed}


async def multi_prompt(target, stop) -> dict:
    """One /v1/completions request of 1,020 prompts after another from the small key (rpm 1, concurrent 1):
    each must be refused or charged as the 1,020 requests it is, never fill the server's queue."""
    body = json.dumps({"model": MODEL, "prompt": ["Once upon a time"] * 1020, "max_tokens": 16}).encode()
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + SMALL_KEY.encode() + b"\r\n"
    )
    statuses = collections.Counter()
    while not stop.is_set():
        statuses[str(await _http_status(target, head, body, "127.0.0.1"))] += 1
    return {"multi_prompt_statuses": dict(statuses)}


async def hostile_template(target, stop) -> dict:
    """Chat requests whose messages make HOSTILE_TEMPLATE run a nested range loop, lipsum(50000) or a 10**8
    character string, in turn (with the key): each must end in a clear 400 while the others are served."""
    results = collections.defaultdict(collections.Counter)
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() + b"\r\n"
    for kind in itertools.cycle(("range_loop", "lipsum", "huge_string")):
        if stop.is_set():
            break
        body = {"model": MODEL, "messages": [{"role": "user", "content": kind}], "max_tokens": 4}
        status = await _http_status(target, head, json.dumps(body).encode(), "127.0.0.1")
        results[kind][str(status)] += 1
    return {"template_statuses": {kind: dict(counts) for kind, counts in results.items()}}


def stream_beside(target: Target, tokens: int = 300):
    """A key holder's streamed generate during the attack, in a thread; the returned function joins it and
    says whether it was lost (did not deliver every token)."""
    got = []

    def run():
        try:
            with target.client(timeout=600) as c:
                got.extend(c.generate_stream("Once upon a time", max_tokens=tokens, ignore_eos=True))
        except (OSError, ConnectionError, RPCError):
            pass

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def lost() -> int:
        thread.join(600)
        return int(sum(len(chunk.token_ids) for chunk in got) != tokens)

    return lost


def http_key_holder(target: Target, attempts: int) -> str:
    """Completions with the key on fresh HTTP connections, one after another: how many were served."""
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() + b"\r\n"
    body = json.dumps({"model": MODEL, "prompt": "Zoo", "max_tokens": 2}).encode()

    async def all_of_them():
        return [await _http_status(target, head, body, "127.0.0.1") for _ in range(attempts)]

    return f"{asyncio.run(all_of_them()).count(200)}/{attempts}"


def key_holder_connects(target: Target, attempts: int) -> dict:
    """Fresh connections with the key, one after another, while the flood holds its connections open: each
    must authenticate and be served; the unauthenticated connections the server held at each is recorded."""
    ok, held = 0, []
    for _ in range(attempts):
        try:
            with target.client(timeout=30) as c:
                stats = c.stats()
                ok += c.health()["status"] == "ok"
                held.append(stats["unauthenticated_connections"])
        except (OSError, ConnectionError):
            pass
    return {
        "key_holder_connects": f"{ok}/{attempts}",
        "unauthenticated_open_at_connects": [min(held), max(held)] if held else None,
    }


# --parts: where a step's time goes. The engine's phases (engine.step = schedule / _advance / _make_batch /
# forward / sample / _update), and within the forward the backend's ops; what is left of the forward is the
# model's own lines. An op called inside another timed one (rms_norm in add_rms_norm) counts in the outer one.
STEP_PARTS = (
    ("scheduler", "schedule"),
    ("engine", "_advance"),
    ("engine", "_make_batch"),
    ("engine", "_forward"),
    ("engine", "_sample"),
    ("engine", "_update"),
)
FORWARD_OPS = (
    "embedding",
    "rms_norm",
    "add_rms_norm",
    "linear",
    "rope_store_kv",
    "paged_attention",
    "silu_and_mul",
)


class StepParts:
    """Times the parts above by `clock` while installed (instance attributes over the methods); `steps` holds
    one {part: seconds} per step ended by end_step()."""

    def __init__(self, engine: LLMEngine, clock):
        self.clock, self.steps, self._step, self._inside = clock, [], {}, False
        owners = {"scheduler": engine.scheduler, "engine": engine}
        self._wrapped = [(owners[owner], name, name.lstrip("_")) for owner, name in STEP_PARTS]
        self._wrapped += [(engine.model.ops, name, "op." + name) for name in FORWARD_OPS]
        for owner, name, part in self._wrapped:
            setattr(owner, name, self._timed(getattr(owner, name), part))

    def _timed(self, method, part):
        def timed(*args, **kwargs):
            if self._inside:  # nested in another timed op: its time is the outer one's
                return method(*args, **kwargs)
            self._inside = part.startswith("op.")
            start = self.clock()
            result = method(*args, **kwargs)
            self._step[part] = self._step.get(part, 0.0) + self.clock() - start
            self._inside = False
            return result

        return timed

    def end_step(self, counted: bool) -> None:
        if counted:
            self.steps.append(self._step)
        self._step = {}

    def uninstall(self) -> None:
        for owner, name, _ in self._wrapped:
            delattr(owner, name)


def engine_steps(
    attack_requests: int,
    stop_lists: bool,
    steps: int,
    engine: LLMEngine,
    clock=time.perf_counter,
    parts: bool = False,
) -> dict:
    """Step times (ms, by `clock`) of `engine` running the bystander's generate and `attack_requests` of the
    stop-list scenario's (or its control's), each replaced as soon as it finishes; and the bystander's
    generates, from added to finished, in steps and ms (the engine's part of its latency). parts: also the
    median time per step of each part (StepParts; the timing itself adds ~40 clock pairs to every step, alike
    at any batch size)."""
    bystander_params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    attack = _greedy_generate(stop_lists)
    # as the server builds them: the attack sets no temperature, so its rows are sampled (temperature 1)
    attack_params = SamplingParams(**{k: v for k, v in attack.items() if k != "prompt"})
    added = iter(range(1 << 62))
    bystander_added: dict[str, tuple[int, float]] = {}  # request id -> (step, time) when added

    def add(params: SamplingParams, step: int) -> None:
        kind = "attack" if params is attack_params else "bystander"
        request_id = f"{kind}-{next(added)}"
        engine.add_request(request_id, attack["prompt"], params, stream=False)
        if params is bystander_params:
            bystander_added[request_id] = (step, clock())

    sampling = []
    launch = engine.sampler.launch

    def timed_launch(*args):
        start = clock()
        pending = launch(*args)
        sampling.append(clock() - start)
        return pending

    engine.sampler.launch = timed_launch
    add(bystander_params, 0)
    for _ in range(attack_requests):
        add(attack_params, 0)
    times, bystander_steps, bystander_ms = [], [], []
    warm_up = 50  # steps: every request past its prefill, the allocator warm
    timed_parts = StepParts(engine, clock) if parts else None
    for i in range(steps + warm_up):
        start = clock()
        outputs = engine.step()
        if i >= warm_up:
            times.append(clock() - start)
        if timed_parts is not None:
            timed_parts.end_step(i >= warm_up)
        for out in outputs:
            if not out.finished:
                continue
            if out.request_id.startswith("attack"):
                add(attack_params, i + 1)
                continue
            step, added_at = bystander_added.pop(out.request_id)
            if step >= warm_up:
                bystander_steps.append(i + 1 - step)
                bystander_ms.append((clock() - added_at) * 1000)
            add(bystander_params, i + 1)
    if timed_parts is not None:
        timed_parts.uninstall()
    for request_id in list(engine.requests):
        engine.abort_request(request_id)
    while engine.has_unfinished_requests():
        engine.step()
    engine.sampler.launch = launch
    ms = np.array(times) * 1000
    report = {
        "attack_requests": attack_requests,
        "stop_lists": stop_lists,
        "median_step_ms": round(float(np.median(ms)), 3),
        "p90_step_ms": round(float(np.percentile(ms, 90)), 3),
        "median_sampling_ms": round(float(np.median(sampling[-steps:])) * 1000, 3),
        "bystander_steps": sorted(set(bystander_steps)),
        "bystander_median_ms": round(float(np.median(bystander_ms)), 2),
    }
    if timed_parts is not None:  # each part's median over the steps (0 in a step that did not run it)
        for step_parts in timed_parts.steps:
            step_parts["forward, the model's own lines"] = step_parts["forward"] - sum(
                v for part, v in step_parts.items() if part.startswith("op.")
            )
        names = dict.fromkeys(part for step_parts in timed_parts.steps for part in step_parts)
        report["median_parts_ms"] = {
            part: round(1000 * float(np.median([p.get(part, 0.0) for p in timed_parts.steps])), 4)
            for part in names
        }
    return report


def engine_only(steps: int, clock, parts: bool, rounds: int) -> None:
    """Each batch `rounds` times over, the batches in turn; per batch the round with the smallest median step
    (the machine's other users only add to a step), and with rounds > 1 every round's median."""
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    engine = LLMEngine(**engine_options_from_args(parser.parse_args([])))  # what `serve` runs
    batches = [(0, False)] + [(n, stop_lists) for n in (8, 32) for stop_lists in (False, True)]
    runs = {batch: [] for batch in batches}
    for _ in range(rounds):
        for attack_requests, stop_lists in batches:
            runs[attack_requests, stop_lists].append(
                engine_steps(attack_requests, stop_lists, steps, engine, clock, parts)
            )
    alone = None
    for batch in batches:
        report = min(runs[batch], key=lambda r: r["median_step_ms"])
        if rounds > 1:
            report["round_median_steps_ms"] = [r["median_step_ms"] for r in runs[batch]]
        if alone is None:
            alone = report
        else:
            report["median_step_over_alone"] = round(report["median_step_ms"] / alone["median_step_ms"], 2)
            report["bystander_median_over_alone"] = round(
                report["bystander_median_ms"] / alone["bystander_median_ms"], 2
            )
        print(json.dumps({"engine_only": report}), flush=True)


def _attack(name: str, target: Target, started, stop, results) -> None:
    started.set()
    results.put(asyncio.run(globals()[name](target, stop)) or {})


def run_attack(name: str, target: Target):
    """The attack in a process of its own: in the bystander's, its work would share the bystander's GIL and
    be counted as the server's latency. Returns (stop event, process, queue of its report)."""
    context = multiprocessing.get_context("spawn")
    started, stop, results = context.Event(), context.Event(), context.Queue()
    process = context.Process(target=_attack, args=(name, target, started, stop, results), daemon=True)
    process.start()
    started.wait(120)  # its imports done
    return stop, process, results


def server_stats(target: Target, steps_since: int | None = None) -> dict:
    """The server's stats; with steps_since, also the summary of its steps from that step on
    (`step_times`)."""
    with target.client() as c:
        return c.stats() if steps_since is None else c.call("stats", {"steps_since": steps_since})


def settle(target: Target) -> dict:
    with target.client() as c:
        for _ in range(600):
            stats = c.stats()
            if (
                stats["pending_requests"] == 0
                and stats["running"] == 0
                and stats["waiting"] == 0
                and stats["pending_calls"] <= 1
                and stats["connections"] <= 1
            ):  # the stats call itself
                break
            time.sleep(0.1)
    return stats


def percentiles(latencies: list[float]) -> dict:
    ms = np.array(latencies) * 1000
    return {
        "p50_ms": round(float(np.percentile(ms, 50)), 1),
        "p99_ms": round(float(np.percentile(ms, 99)), 1),
        "max_ms": round(float(ms.max()), 1),
    }  # with 40 samples p99 lies between the two slowest


_saved_fd_limit: list = []


@contextlib.contextmanager
def _fd_limit(soft: int):
    """The server (started inside) gets `soft` file descriptors, as the issue's probe had; this process gets
    its own back once the server runs (_fd_limit_restored), for the attackers' connections."""
    _saved_fd_limit[:] = [resource.getrlimit(resource.RLIMIT_NOFILE)]
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, _saved_fd_limit[0][1]), _saved_fd_limit[0][1]))
    try:
        yield
    finally:
        _fd_limit_restored()


def _fd_limit_restored() -> None:
    if _saved_fd_limit:
        resource.setrlimit(resource.RLIMIT_NOFILE, _saved_fd_limit.pop())


def _server_files(tmp: str, tls: bool) -> list[str]:
    """The keys file (KEY unlimited, SMALL_KEY at rpm 1, concurrent 1), HOSTILE_TEMPLATE, and with tls a
    certificate made by trustme; the serve flags that use them."""
    keys = os.path.join(tmp, "keys.toml")
    with open(keys, "w") as f:
        f.write(f'[[keys]]\nname = "bystander"\nsha256 = "{hash_secret(KEY)}"\n\n')
        f.write(f'[[keys]]\nname = "small"\nsha256 = "{hash_secret(SMALL_KEY)}"\nrpm = 1\nconcurrent = 1\n')
    template = os.path.join(tmp, "hostile.jinja")
    with open(template, "w") as f:
        f.write(HOSTILE_TEMPLATE)
    flags = ["--keys-file", keys, "--http-port", "0", "--chat-template", template]
    flags += ["--max-unauthenticated-connections", "1024", "--max-unauthenticated-per-address", "1024"]
    if tls:
        import trustme  # the test extra

        ca = trustme.CA()
        cert = ca.issue_cert("127.0.0.1")
        cert.private_key_and_cert_chain_pem.write_to_path(os.path.join(tmp, "server.pem"))
        ca.cert_pem.write_to_path(_ca_file(tmp, tls))
        flags += ["--tls-cert", os.path.join(tmp, "server.pem"), "--tls-key", os.path.join(tmp, "server.pem")]
    return flags


def _ca_file(tmp: str, tls: bool) -> str | None:
    return os.path.join(tmp, "ca.pem") if tls else None


def _loop_cpu_s(server) -> float:
    """CPU seconds the server's main thread (its event loop) has used so far."""
    with open(f"/proc/{server.proc.pid}/task/{server.proc.pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def scenario_report(name: str, target: Target, server, args) -> dict:
    """One scenario against the running server: its report (the bystander, the attack, the server after)."""
    report = {"scenario": name, "tls": args.tls}
    if name == "connection_bursts":
        levels, unserved = asyncio.run(
            connection_bursts(server.port, args.bursts, args.burst_connections, server.rss_mb)
        )
        report.update(
            rss_mb_after_each_burst=levels,
            unserved_per_burst=unserved,
            rss_growth_mb_burst3_to_8=round(
                levels[min(7, len(levels) - 1)] - levels[min(2, len(levels) - 1)], 1
            ),
        )
    else:
        # The idle latency again, just before: the machine is shared, its load drifts over a run.
        first_step = server_stats(target)["steps"]
        idle_now = percentiles(bystander(target, args.samples))
        idle_steps = server_stats(target, first_step)["step_times"]
        stop, process, results = run_attack(name, target)
        time.sleep(2.0)  # the attack under way
        lost = stream_beside(target) if name in STREAM_BESIDE else None
        first_step = server_stats(target)["steps"]
        loop_cpu_before, bystander_start = _loop_cpu_s(server), time.perf_counter()
        latencies = bystander(target, args.samples)
        loop_cpu = (_loop_cpu_s(server) - loop_cpu_before) / (time.perf_counter() - bystander_start)
        if name in ("unauthenticated_flood", "slowloris"):  # while their connections are open
            report.update(key_holder_connects(target, 20))
        if name == "slowloris":
            report["http_key_holder_served"] = http_key_holder(target, 20)
        held = server_stats(target, first_step)
        if lost is not None:
            report["lost_streams"] = lost()
        stop.set()
        report.update(results.get(timeout=120))
        process.join(timeout=120)
        report.update(
            percentiles(latencies),
            idle_before=idle_now,
            p99_over_idle_p50=round(percentiles(latencies)["p99_ms"] / idle_now["p50_ms"], 2),
            p99_over_idle_p99=round(percentiles(latencies)["p99_ms"] / idle_now["p99_ms"], 2),
            loop_cpu_share=round(loop_cpu, 2),
            during={
                k: held[k]
                for k in (
                    "paused",
                    "write_buffer_bytes",
                    "pending_calls",
                    "unauthenticated_connections",
                    "connections",
                )
            },
            server_steps={"idle_before": idle_steps, "during": held["step_times"]},
        )
    settle_stats = settle(target)
    report.update(
        kv_blocks_used_after=settle_stats["kv_blocks_used"],
        pending_after=settle_stats["pending_requests"],
        rss_mb=round(server.rss_mb(), 1),
        open_fds=server.open_fds(),
    )
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.hostile_clients",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument(
        "--samples", type=int, default=100, help="bystander generates per scenario (and idle before each)"
    )
    parser.add_argument("--bursts", type=int, default=10)
    parser.add_argument("--burst-connections", type=int, default=1000)
    parser.add_argument("--stalled", type=int, default=STALLED, help="slowloris: connections held stalled")
    parser.add_argument(
        "--tls", action="store_true", help=f"serve TLS (runs {', '.join(TLS_SCENARIOS)} only)"
    )
    parser.add_argument(
        "--accept-rate",
        type=float,
        default=0.0,
        help="the server's --accept-rate-per-address (new connections per second per address; 0: off)",
    )
    parser.add_argument("--engine-only", action="store_true", help="time the engine's steps alone, no server")
    parser.add_argument("--steps", type=int, default=1000, help="timed steps per batch with --engine-only")
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="--engine-only: wall time, or the thread's CPU time (less moved by other users' work)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="--engine-only: every batch this many times over, "
        "in turn; the round with the smallest median is shown",
    )
    parser.add_argument(
        "--parts",
        action="store_true",
        help="--engine-only: also the median time per step of the engine's phases and the forward's ops",
    )
    args = parser.parse_args(argv)
    if args.engine_only:
        engine_only(
            args.steps,
            time.perf_counter if args.clock == "wall" else time.thread_time,
            args.parts,
            args.rounds,
        )
        return 0
    names = args.scenarios.split(",")
    if args.tls and set(names) - set(TLS_SCENARIOS):
        parser.error(f"--tls runs only {', '.join(TLS_SCENARIOS)}")
    with tempfile.TemporaryDirectory() as tmp, _fd_limit(FD_LIMIT):
        serve_args = [*_server_files(tmp, args.tls), "--accept-rate-per-address", str(args.accept_rate)]
        with serving(*serve_args) as server:
            _fd_limit_restored()
            line = server.proc.stdout.readline()  # the HTTP door's address follows the msgpack door's
            target = Target(server.port, int(line.rpartition(":")[2]), _ca_file(tmp, args.tls), args.stalled)
            bystander(target, 5)  # warm up
            idle = percentiles(bystander(target, args.samples))
            print(json.dumps({"scenario": "idle", **idle}), flush=True)
            for name in names:
                report = {"scenario": name, "tls": args.tls}
                try:
                    report = scenario_report(name, target, server, args)
                except (TimeoutError, OSError) as e:  # the server stopped answering (a template that never
                    report["server_unresponsive"] = repr(e)  # ends, say): the rest cannot run
                    print(json.dumps(report), flush=True)
                    server.proc.kill()
                    break
                print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
