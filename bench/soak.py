"""Soak: rounds of many concurrent greedy streams; every output exact, the KV pool free, RSS and fds flat.

    python -m bench.soak                           # 1000 streams x 10 rounds (docs/reliability.md)
    python -m bench.soak --streams 200 --rounds 3  # quicker

Each round opens --connections connections and runs --streams streamed greedy requests spread over them, all
at once. Outputs are checked token for token against offline LLM.generate of the same (prompt, max_tokens);
the streamed pieces must concatenate to the final text. After every round the server must hold no request
and no KV block, and its RSS (once it has been idle long enough to give back the memory it keeps free for
steps) and open-fd count are recorded. One JSON line per round, then a summary line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from bench.server_process import serving
from minisarathi.client import AsyncClient, Client
from minisarathi.server.engine_worker import IDLE_RELEASE_S

PROMPTS = [
    "Once upon a time",
    "Tom had a red",
    "Lily and Tom went to the park.",
    "The cat",
    "One day, a little",
    "Zoo",
    "She saw a big",
    "He liked to play with his toys and",
]


def requests(n: int) -> list[tuple[str, int]]:
    return [(PROMPTS[i % len(PROMPTS)], 8 + (i * 7) % 25) for i in range(n)]


def offline(pairs) -> dict:
    from minisarathi.llm import LLM
    from minisarathi.sampling_params import SamplingParams

    distinct = sorted(set(pairs))
    outs = LLM().generate(
        [p for p, _ in distinct], [SamplingParams(temperature=0, max_tokens=n) for _, n in distinct]
    )
    return {pair: out.outputs[0].token_ids for pair, out in zip(distinct, outs)}


async def one_round(port: int, pairs, connections: int):
    clients = [await AsyncClient("127.0.0.1", port).connect() for _ in range(connections)]

    async def stream(client, prompt, n):
        s = client.generate_stream(prompt, max_tokens=n, temperature=0)
        pieces = [chunk async for chunk in s]
        return s.result, "".join(c.text for c in pieces), [t for c in pieces for t in c.token_ids]

    try:
        return await asyncio.gather(
            *(stream(clients[i % connections], p, n) for i, (p, n) in enumerate(pairs))
        )
    finally:
        for client in clients:
            await client.close()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.soak", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--connections", type=int, default=50)
    args = parser.parse_args(argv)
    pairs = requests(args.streams)
    expected = offline(pairs)
    lost = corrupted = 0
    rows = []
    with serving("--max-queued-requests", str(args.streams + 24)) as server:
        for round_index in range(args.rounds):
            start = time.monotonic()
            results = asyncio.run(one_round(server.port, pairs, args.connections))
            for (result, text, ids), pair in zip(results, pairs):
                if result is None:
                    lost += 1
                elif result.token_ids != expected[pair] or ids != result.token_ids or text != result.text:
                    corrupted += 1
            with Client("127.0.0.1", server.port) as c:
                for _ in range(100):
                    stats = c.stats()
                    if stats["pending_requests"] == 0 and stats["running"] == 0:
                        break
                    time.sleep(0.05)
            seconds = time.monotonic() - start
            time.sleep(IDLE_RELEASE_S + 0.5)  # idle: the server gives back the memory it kept free for steps
            row = {
                "round": round_index + 1,
                "seconds": round(seconds, 2),
                "kv_blocks_used": stats["kv_blocks_used"],
                "pending": stats["pending_requests"],
                "rss_mb": round(server.rss_mb(), 1),
                "open_fds": server.open_fds(),
                "lost": lost,
                "corrupted": corrupted,
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    summary = {
        "streams": args.streams,
        "rounds": args.rounds,
        "lost": lost,
        "corrupted": corrupted,
        "kv_always_free": all(r["kv_blocks_used"] == 0 for r in rows),
        "rss_mb_first_last": [rows[0]["rss_mb"], rows[-1]["rss_mb"]],
        "open_fds_first_last": [rows[0]["open_fds"], rows[-1]["open_fds"]],
    }
    print(json.dumps(summary))
    return 0 if lost == corrupted == 0 and summary["kv_always_free"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
