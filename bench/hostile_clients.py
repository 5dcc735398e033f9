"""Greedy and unauthenticated clients against a bystander: its latency, the server's memory, the KV pool.

    python -m bench.hostile_clients                      # every scenario (docs/reliability.md)
    python -m bench.hostile_clients --scenarios unread_streams,unauthenticated_flood --samples 20

A server with an API key runs the bundled model. A bystander (with the key) times back-to-back greedy
24-token generates: first alone (idle), then while each attacker runs:

  stop_lists              4 connections x 8 generates in flight with maximal legal stop lists (16 strings,
                          1024 characters) and 64 stop token ids
  tokenize                4 connections calling maximal tokenize (256 KiB) and detokenize (65536 ids)
  unread_streams          256 streamed 500-token generates whose client never reads
  unauthenticated_flood   1000 connections without the key, each trickling an auth message at 1 byte/s;
                          while they are open, 20 fresh key holders connect one after another (they must
                          all get in)
  connection_bursts       10 bursts of 1000 connections (auth, health, close): server RSS after each

After each scenario the server must return to no request held and every KV block free. One JSON line per
scenario: bystander p50/p99 (ms) and p99 over the idle p50, plus what the scenario checks.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import tempfile
import threading
import time

import msgpack
import numpy as np

from minisarathi.client import Client

from bench.server_process import serving

KEY = "bench-hostile-clients-key"
SCENARIOS = ("stop_lists", "tokenize", "unread_streams", "unauthenticated_flood", "connection_bursts")


def bystander(port: int, samples: int) -> list[float]:
    latencies = []
    with Client("127.0.0.1", port, api_key=KEY, timeout=600) as c:
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


async def _pump(reader, writer, requests, in_flight: int, stop: threading.Event):
    """Keep `in_flight` of the requests (msgpack-packed) outstanding, reading every answer."""
    unpacker = msgpack.Unpacker()
    sent = answered = 0
    while not stop.is_set():
        while sent - answered < in_flight:
            writer.write(requests[sent % len(requests)])
            sent += 1
        data = await reader.read(1 << 16)
        if not data:
            return
        unpacker.feed(data)
        answered += sum(1 for m in unpacker if m[0] == 1 and m[1] != 0)


async def stop_lists(port, stop: threading.Event):
    rng = np.random.default_rng(0)
    stops = ["".join(chr(c) for c in rng.integers(0x4e00, 0x9fff, 64)) for _ in range(16)]
    request = msgpack.packb([0, 1, "generate", [{"prompt": "Once upon a time", "max_tokens": 128, "stop": stops,
                                                 "stop_token_ids": list(range(400, 464)), "min_tokens": 100}]])
    conns = [await _connect(port) for _ in range(4)]
    await asyncio.gather(*(_pump(r, w, [request], 8, stop) for r, w in conns))


async def tokenize(port, stop: threading.Event):
    text = ("Once upon a time there was a big red ball. " * 6000)[:256 << 10]
    requests = [msgpack.packb([0, 1, "tokenize", [text]]), msgpack.packb([0, 2, "detokenize", [[400] * 65536]])]
    conns = [await _connect(port) for _ in range(4)]
    await asyncio.gather(*(_pump(r, w, requests, 2, stop) for r, w in conns))


async def unread_streams(port, stop: threading.Event):
    socks = []
    for c in range(2):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", port))
        sock.sendall(msgpack.packb([0, 0, "auth", [KEY]]) + b"".join(
            msgpack.packb([0, i, "generate", [{"prompt": "Once upon a time", "max_tokens": 500, "ignore_eos": True,
                                               "stream": True}]]) for i in range(1, 129)))
        socks.append(sock)
    while not stop.is_set():
        await asyncio.sleep(0.1)
    for sock in socks:
        sock.close()


async def unauthenticated_flood(port, stop: threading.Event, report: dict):
    message = msgpack.packb([0, 1, "auth", ["x" * 64]])
    closed = 0

    async def trickler():
        nonlocal closed
        while not stop.is_set():
            try:
                reader, writer = await _connect(port, key=False)
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
    report.update(flood_connections_closed_by_server=closed)


async def connection_bursts(port, bursts: int, per_burst: int, rss) -> list[float]:
    levels = []
    for _ in range(bursts):
        async def one():
            reader, writer = await _connect(port)
            writer.write(msgpack.packb([0, 1, "health", []]))
            unpacker = msgpack.Unpacker()
            answered = 0
            while answered < 2 and (data := await reader.read(1 << 16)):
                unpacker.feed(data)
                answered += sum(1 for _ in unpacker)
            writer.close()
        await asyncio.gather(*(one() for _ in range(per_burst)))
        await asyncio.sleep(0.5)
        levels.append(round(rss(), 1))
    return levels


def key_holder_connects(port: int, attempts: int) -> dict:
    """Fresh connections with the key, one after another, while the flood holds its connections open: each
    must authenticate and be served; the unauthenticated connections the server held at each is recorded."""
    ok, held = 0, []
    for _ in range(attempts):
        try:
            with Client("127.0.0.1", port, api_key=KEY, timeout=30) as c:
                stats = c.stats()
                ok += c.health()["status"] == "ok"
                held.append(stats["unauthenticated_connections"])
        except (OSError, ConnectionError):
            pass
    return {"key_holder_connects": f"{ok}/{attempts}",
            "unauthenticated_open_at_connects": [min(held), max(held)] if held else None}


def run_attack(attack, port, report) -> tuple[threading.Event, threading.Thread]:
    stop = threading.Event()
    args = (port, stop, report) if attack is unauthenticated_flood else (port, stop)
    thread = threading.Thread(target=lambda: asyncio.run(attack(*args)), daemon=True)
    thread.start()
    return stop, thread


def settle(port: int) -> dict:
    with Client("127.0.0.1", port, api_key=KEY, timeout=60) as c:
        for _ in range(600):
            stats = c.stats()
            if (stats["pending_requests"] == 0 and stats["running"] == 0 and stats["waiting"] == 0
                    and stats["pending_calls"] <= 1):   # the stats call itself
                break
            time.sleep(0.1)
    return stats


def percentiles(latencies: list[float]) -> dict:
    ms = np.array(latencies) * 1000
    return {"p50_ms": round(float(np.percentile(ms, 50)), 1), "p99_ms": round(float(np.percentile(ms, 99)), 1)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.hostile_clients", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--samples", type=int, default=40, help="bystander generates per scenario")
    parser.add_argument("--bursts", type=int, default=10)
    parser.add_argument("--burst-connections", type=int, default=1000)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        key_file = os.path.join(tmp, "key")
        with open(key_file, "w") as f:
            f.write(KEY)
        with serving("--api-key-file", key_file, "--max-unauthenticated-connections", "1024",
                     "--max-unauthenticated-per-address", "1024") as server:
            bystander(server.port, 5)   # warm up
            idle = percentiles(bystander(server.port, args.samples))
            print(json.dumps({"scenario": "idle", **idle}), flush=True)
            for name in args.scenarios.split(","):
                report = {"scenario": name}
                if name == "connection_bursts":
                    levels = asyncio.run(connection_bursts(server.port, args.bursts, args.burst_connections,
                                                           server.rss_mb))
                    report.update(rss_mb_after_each_burst=levels,
                                  rss_growth_mb_burst3_to_8=round(levels[min(7, len(levels) - 1)] - levels[min(2, len(levels) - 1)], 1))
                else:
                    stop, thread = run_attack(globals()[name], server.port, report)
                    time.sleep(2.0)   # the attack under way
                    latencies = bystander(server.port, args.samples)
                    if name == "unauthenticated_flood":   # while the flood's connections are still open
                        report.update(key_holder_connects(server.port, 20))
                    held = settle_stats = None
                    with Client("127.0.0.1", server.port, api_key=KEY) as c:
                        held = c.stats()
                    stop.set()
                    thread.join(timeout=120)
                    report.update(percentiles(latencies),
                                  p99_over_idle_p50=round(percentiles(latencies)["p99_ms"] / idle["p50_ms"], 2),
                                  during={k: held[k] for k in ("paused", "write_buffer_bytes", "pending_calls",
                                                               "unauthenticated_connections", "connections")})
                settle_stats = settle(server.port)
                report.update(kv_blocks_used_after=settle_stats["kv_blocks_used"],
                              pending_after=settle_stats["pending_requests"], rss_mb=round(server.rss_mb(), 1),
                              open_fds=server.open_fds())
                print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
