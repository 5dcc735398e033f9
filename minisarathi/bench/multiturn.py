"""A multi-turn chat workload: each session's prompt is its previous prompt, the answer it got, and a new
message, so a replica that served the previous turn has most of the prompt in its prefix cache.

Sessions run concurrently, the turns of one session one after another (a turn needs the previous answer).
Every turn opens its own connection, as a stateless client does, so the balancer routes every turn: with
session affinity the turns of a session meet the same replica, with round robin they wander. Per turn it
records TTFT (send to first streamed token), the prompt's tokens and how many of them the replica served
from its prefix cache (the server reports them: msgpack `cached_tokens`, HTTP usage.prompt_tokens_details).

Doors: msgpack (session key = the client's address: session s connects from 127.0.0.(10+s), which nginx's
`hash $remote_addr` and HAProxy's `balance source` see) and http (session key = the X-Session-Id header).
"""

from __future__ import annotations

import functools
import http.client
import json
import threading
import time
from dataclasses import asdict, dataclass

import numpy as np

from minisarathi.bench.metrics import summarize
from minisarathi.client import Client

# Plain words the bundled story model knows, for messages that read like a user's.
WORDS = (
    "the little girl saw a big red ball in the park and she wanted to play with her friend tom "
    "they ran to the tree where a bird sang happy songs every day mom said it was time to go home"
).split()


@dataclass
class MultiTurnConfig:
    num_sessions: int = 8
    num_turns: int = 4
    first_message_words: int = 48
    message_words: int = 12
    answer_tokens: int = 16  # forced (ignore_eos), greedy
    seed: int = 0

    def messages(self) -> list[list[str]]:
        """Per session, per turn, the user's new message."""
        rng = np.random.default_rng(self.seed)
        return [
            [
                " ".join(rng.choice(WORDS, self.first_message_words if t == 0 else self.message_words))
                for t in range(self.num_turns)
            ]
            for _ in range(self.num_sessions)
        ]


@dataclass
class TurnRecord:
    session: int
    turn: int
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ttft_s: float | None = None
    e2e_s: float | None = None
    error: str | None = None


def run_multiturn(config: MultiTurnConfig, door: str, port: int, host: str = "127.0.0.1") -> list[TurnRecord]:
    """Run every session to its last turn (a failed turn ends its session); records in session, turn order."""
    if door not in ("msgpack", "http"):
        raise ValueError(f"door must be 'msgpack' or 'http', got {door!r}")
    records: list[list[TurnRecord]] = [[] for _ in range(config.num_sessions)]
    if door == "msgpack":
        turn = _msgpack_turn
    else:
        turn = functools.partial(_http_turn, model=served_model(host, port))

    def session(s: int, messages: list[str]):
        prompt = ""
        for t, message in enumerate(messages):
            prompt = f"{prompt} {message}" if prompt else message
            record = TurnRecord(s, t)
            records[s].append(record)
            try:
                answer = turn(host, port, s, prompt, config.answer_tokens, record)
            except Exception as e:  # recorded: a failed turn is a result of the run, not a crash of it
                record.error = f"{type(e).__name__}: {e}"
                return
            prompt += answer

    threads = [threading.Thread(target=session, args=(s, m)) for s, m in enumerate(config.messages())]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [r for session_records in records for r in session_records]


def summarize_turns(records: list[TurnRecord]) -> dict:
    """Prefix-cache hit rate (cached / prompt tokens) and TTFT over the turns after the first (the first turn
    of a session has nothing to hit), and over all turns; failed turns counted."""
    done = [r for r in records if r.error is None]
    later = [r for r in done if r.turn > 0]

    def hit_rate(rs):
        prompt = sum(r.prompt_tokens for r in rs)
        return sum(r.cached_tokens for r in rs) / prompt if prompt else None

    return {
        "turns": len(records),
        "failed": len(records) - len(done),
        "hit_rate_later_turns": hit_rate(later),
        "hit_rate_all_turns": hit_rate(done),
        "ttft_s_later_turns": summarize(r.ttft_s for r in later),
        "ttft_s_all_turns": summarize(r.ttft_s for r in done),
    }


def records_as_dicts(records: list[TurnRecord]) -> list[dict]:
    return [asdict(r) for r in records]


def _msgpack_turn(
    host: str, port: int, session: int, prompt: str, answer_tokens: int, record: TurnRecord
) -> str:
    sent = time.monotonic()
    with Client(host, port, source_address=(f"127.0.0.{10 + session}", 0), timeout=300) as client:
        stream = client.generate_stream(prompt, max_tokens=answer_tokens, ignore_eos=True, temperature=0)
        for _ in stream:
            if record.ttft_s is None:
                record.ttft_s = time.monotonic() - sent
    record.e2e_s = time.monotonic() - sent
    record.prompt_tokens = stream.result.prompt_tokens
    record.cached_tokens = stream.result.extra["cached_tokens"]
    return stream.result.text


def served_model(host: str, port: int) -> str:
    """The model name an HTTP door serves (GET /v1/models)."""
    conn = http.client.HTTPConnection(host, port, timeout=60)
    try:
        conn.request("GET", "/v1/models")
        return json.loads(conn.getresponse().read())["data"][0]["id"]
    finally:
        conn.close()


def _http_turn(
    host: str, port: int, session: int, prompt: str, answer_tokens: int, record: TurnRecord, model: str
) -> str:
    sent = time.monotonic()
    conn = http.client.HTTPConnection(host, port, timeout=300)
    try:
        conn.request(
            "POST",
            "/v1/completions",
            json.dumps(
                {
                    "model": model,
                    "prompt": prompt,
                    "max_tokens": answer_tokens,
                    "ignore_eos": True,
                    "temperature": 0,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
            ),
            {"Content-Type": "application/json", "X-Session-Id": f"session-{session}"},
        )
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {response.read()[:200]!r}")
        text = []
        for line in response:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("choices"):  # a token arrived (its text may be held back: an incomplete character)
                if record.ttft_s is None:
                    record.ttft_s = time.monotonic() - sent
                text.append(event["choices"][0].get("text", ""))
            if event.get("usage"):
                record.prompt_tokens = event["usage"]["prompt_tokens"]
                record.cached_tokens = event["usage"]["prompt_tokens_details"]["cached_tokens"]
    finally:
        conn.close()
    record.e2e_s = time.monotonic() - sent
    return "".join(text)
