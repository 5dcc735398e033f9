"""API keys, per-key quotas and failed-auth throttling, shared by every door (msgpack, HTTP).

A keys file is TOML with one `[[keys]]` table per key; the secret itself is never stored, only its SHA-256
(keys are 256-bit random strings, so a fast hash is enough: there is nothing to brute-force). `minisarathi
keys add NAME --file keys.toml` makes one:

    [[keys]]
    name = "alice"
    sha256 = "3f0a..."           # of the secret, hex
    rpm = 60                     # optional: requests per minute
    tpm = 100000                 # optional: tokens per minute (prompt + max_tokens charged at admission,
                                 #           what was not generated refunded at finish)
    concurrent = 8               # optional: requests in flight at once
    max_tokens = 1024            # optional: cap on a request's max_tokens
    priority = 0                 # optional: default priority of its requests (lower runs first)

Quotas are token buckets (capacity one minute's worth, refilled continuously) checked before a request
reaches the engine. A reload (SIGHUP) keeps each name's bucket levels and in-flight counts.
"""

from __future__ import annotations

import hashlib
import logging
import math
import re
import secrets
import string
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from minisarathi.validation import PRIORITY_RANGE

log = logging.getLogger("minisarathi.server")

KEY_PREFIX = "ms-"
NAME_RULE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_LIMIT_FIELDS = ("rpm", "tpm", "concurrent", "max_tokens")
_FIELDS = {"name", "sha256", "priority", *_LIMIT_FIELDS}
UNNAMED = "default"  # the name of the one key given with --api-key-file / MINISARATHI_API_KEY
MIN_SECRET_BITS = 128  # a key served beyond loopback must be at least this hard to guess
_CHARACTER_CLASSES = (string.ascii_lowercase, string.ascii_uppercase, string.digits)


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


def new_secret() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def secret_bits(secret: str) -> float:
    """Bits of entropy of a secret at best: its length x log2 of the alphabet its character classes span
    (lowercase, uppercase, digits, the rest as 32 more). An upper bound for a chosen one, exact for a random
    one: `hunter2` has 36, a `keys add` secret over 256."""
    alphabet = sum(len(c) for c in _CHARACTER_CLASSES if any(ch in c for ch in secret))
    if any(not any(ch in c for c in _CHARACTER_CLASSES) for ch in secret):
        alphabet += 32
    return len(secret) * math.log2(max(alphabet, 2))


@dataclass(frozen=True)
class Key:
    name: str
    sha256: str
    rpm: int | None = None
    tpm: int | None = None
    concurrent: int | None = None
    max_tokens: int | None = None
    priority: int = 0


class _Bucket:
    """Token bucket of `per_minute` capacity, refilled at per_minute/60 per second."""

    def __init__(self, per_minute: int):
        self.capacity = float(per_minute)
        self.level = float(per_minute)
        self.updated = time.monotonic()

    def refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.updated) * self.capacity / 60.0)
        self.updated = now

    def wait_s(self, amount: float) -> float:
        """Seconds until `amount` is available (0 if it is now)."""
        return max(0.0, (amount - self.level) * 60.0 / self.capacity)


@dataclass
class Quota:
    """One key's live limits: its buckets and in-flight count. Every door calls admit() before queueing a
    request and finish() when it ends, whatever the outcome."""

    key: Key
    requests: _Bucket | None = None
    tokens: _Bucket | None = None
    inflight: int = 0
    counters: dict = field(
        default_factory=lambda: {"requests": 0, "rate_limited": 0, "prompt_tokens": 0, "completion_tokens": 0}
    )

    def __post_init__(self):
        self.configure(self.key)

    def configure(self, key: Key) -> None:
        """Take (new) limits, keeping the levels of buckets that stay."""
        self.key = key
        self.requests = _resized(self.requests, key.rpm)
        self.tokens = _resized(self.tokens, key.tpm)

    def wait_s(self, tokens: int, requests: int = 1) -> float:
        """Seconds until `requests` requests of `tokens` tokens in all would be admitted (0: now; inf:
        never, more than the key's per-minute or concurrent limits). Charges nothing."""
        now = time.monotonic()
        wait = 0.0
        if self.key.concurrent is not None and self.inflight + requests > self.key.concurrent:
            wait = float("inf") if requests > self.key.concurrent else 1.0  # 1: when a running one ends
        for bucket, amount in ((self.requests, requests), (self.tokens, tokens)):
            if bucket is not None:
                bucket.refill(now)
                if amount > bucket.capacity:
                    wait = float("inf")
                wait = max(wait, bucket.wait_s(amount))
        return wait

    def admit(self, tokens: int, requests: int = 1) -> float | None:
        """Charge `requests` requests (an HTTP request's prompts x n choices) of `tokens` in all (prompts
        + max_tokens of every choice); None if admitted, else wait_s."""
        wait = self.wait_s(tokens, requests)
        if wait > 0:
            self.counters["rate_limited"] += 1
            return wait
        if self.requests is not None:
            self.requests.level -= requests
        if self.tokens is not None:
            self.tokens.level -= tokens
        self.inflight += requests
        self.counters["requests"] += requests
        return None

    def finish(
        self, charged: int, prompt_tokens: int, completion_tokens: int, requests: int = 1, refunded: int = 0
    ) -> None:
        """`requests` admitted with `charged` tokens ended having used prompt + completion tokens; `refunded`
        of them never ran (the engine refused them), and their request units come back too."""
        self.inflight -= requests
        self.counters["prompt_tokens"] += prompt_tokens
        self.counters["completion_tokens"] += completion_tokens
        now = time.monotonic()
        if self.tokens is not None:
            self.tokens.refill(now)
            unused = charged - prompt_tokens - completion_tokens
            self.tokens.level = min(self.tokens.capacity, self.tokens.level + max(unused, 0))
        if refunded and self.requests is not None:
            self.requests.refill(now)
            self.requests.level = min(self.requests.capacity, self.requests.level + refunded)


def _resized(bucket: _Bucket | None, per_minute: int | None) -> _Bucket | None:
    if per_minute is None:
        return None
    if bucket is None:
        return _Bucket(per_minute)
    bucket.refill(time.monotonic())
    bucket.capacity = float(per_minute)
    bucket.level = min(bucket.level, bucket.capacity)
    return bucket


class KeyStore:
    """The keys a server accepts: from a keys file (reloadable), or one unnamed key."""

    def __init__(self, keys: list[Key], path: Path | None = None):
        self.path = path
        self._by_hash: dict[str, Key] = {}
        self.quotas: dict[str, Quota] = {}  # by key name; survives reloads
        self._install(keys)

    @classmethod
    def from_file(cls, path: str | Path) -> KeyStore:
        path = Path(path)
        return cls(read_keys_file(path), path)

    @classmethod
    def single(cls, secret: str) -> KeyStore:
        return cls([Key(UNNAMED, hash_secret(secret))])

    def authenticate(self, secret: str) -> Key | None:
        """The key of this secret; None for any other, text that is not UTF-8 (an undecodable header) too."""
        try:
            digest = hash_secret(secret)
        except UnicodeEncodeError:
            return None
        # A dict lookup by the hash: its timing can reveal only bits of a SHA-256, never of a secret.
        return self._by_hash.get(digest)

    def quota(self, key: Key) -> Quota:
        return self.quotas[key.name]

    def current(self, key: Key) -> Key | None:
        """The key as the file now says (after a reload), or None if it was removed or its secret changed."""
        now = self._by_hash.get(key.sha256)
        return now if now is not None and now.name == key.name else None

    def reload(self) -> None:
        """Re-read the keys file; on any error the keys in force stay and the error is raised."""
        if self.path is not None:
            self._install(read_keys_file(self.path))

    def _install(self, keys: list[Key]) -> None:
        self._by_hash = {k.sha256: k for k in keys}
        for key in keys:
            if key.name in self.quotas:
                self.quotas[key.name].configure(key)
            else:
                self.quotas[key.name] = Quota(key)
        # keep the quotas of removed keys only while requests admitted under them still run
        self.quotas = {n: q for n, q in self.quotas.items() if n in {k.name for k in keys} or q.inflight}


def read_keys_file(path: Path) -> list[Key]:
    """The file's keys; ValueError naming the file, the entry and the rule for anything wrong."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ValueError(f"keys file {str(path)!r}: cannot be read ({e.strerror})") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"keys file {str(path)!r}: not valid TOML ({e})") from None
    entries = data.get("keys", [])
    if set(data) - {"keys"} or not isinstance(entries, list):
        raise ValueError(f"keys file {str(path)!r}: must hold only [[keys]] tables")
    keys, names, hashes = [], set(), set()
    for i, entry in enumerate(entries):
        where = f"keys file {str(path)!r}, key {i + 1}"
        unknown = set(entry) - _FIELDS
        if unknown:
            raise ValueError(f"{where}: unknown field {sorted(unknown)[0]!r}")
        name, digest = entry.get("name"), entry.get("sha256")
        if not isinstance(name, str) or not NAME_RULE.fullmatch(name):
            raise ValueError(f"{where}: name must be 1-64 of A-Z a-z 0-9 _ . -, got {name!r}")
        if not isinstance(digest, str) or not re.fullmatch(r"[0-9a-f]{64}", digest):
            raise ValueError(f"{where} ({name}): sha256 must be 64 lowercase hex digits")
        if name in names or digest in hashes:
            raise ValueError(f"{where} ({name}): name and sha256 must be unique in the file")
        for limit in (*_LIMIT_FIELDS, "priority"):
            rule = limit_rule_broken(limit, entry.get(limit))
            if rule:
                raise ValueError(f"{where} ({name}): {limit} {rule}, got {entry[limit]!r}")
        names.add(name)
        hashes.add(digest)
        keys.append(Key(**{k: v for k, v in entry.items()}))
    return keys


def limit_rule_broken(field: str, value) -> str | None:
    """The rule a key's quota field or priority breaks with `value` ("must be ..."), None if it keeps it."""
    if value is None:
        return None
    if field == "priority":
        low, high = PRIORITY_RANGE  # the engine's: a key outside it would fail every request it sends
        return (
            None if type(value) is int and low <= value <= high else f"must be an integer in [{low}, {high}]"
        )
    return None if type(value) is int and value >= 1 else "must be a positive integer"


def add_key(path: Path, name: str, **limits: int | None) -> str:
    """Append a new key to the keys file (created if missing); returns its secret, which is stored nowhere.
    Everything is checked before the file is touched: a refused key leaves it as it was."""
    if not NAME_RULE.fullmatch(name):
        raise ValueError(f"NAME must be 1-64 of A-Z a-z 0-9 _ . -, got {name!r}")
    for field_name, value in limits.items():
        if field_name not in (*_LIMIT_FIELDS, "priority"):
            raise ValueError(f"unknown key field {field_name!r}")
        rule = limit_rule_broken(field_name, value)
        if rule:
            raise ValueError(f"{field_name} {rule}, got {value!r}")
    existing = read_keys_file(path) if path.exists() else []
    if any(k.name == name for k in existing):
        raise ValueError(f"keys file {str(path)!r} already has a key named {name!r}")
    secret = new_secret()
    lines = ["", "[[keys]]", f'name = "{name}"', f'sha256 = "{hash_secret(secret)}"']
    lines += [f"{k} = {v}" for k, v in limits.items() if v is not None]
    try:
        with open(path, "a", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")
    except OSError as e:
        raise ValueError(f"keys file {str(path)!r}: cannot be written ({e.strerror})") from None
    return secret
