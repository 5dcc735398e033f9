"""Replicas behind a real load balancer, on one machine: the recipes of deploy/ run by nginx or HAProxy in
front of `minisarathi serve` processes, for tests/system/test_deploy.py and bench/deploy.py.

A recipe is used as written, with its example addresses (127.0.0.1:7000-7002 msgpack, 8000-8002 HTTP)
replaced by free ports, its affinity line optionally removed (round robin), and optionally the lines of
docs/deploy.md that make the balancer start each connection with a PROXY protocol header (for replicas run
with --proxy-protocol-from).
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgpack

from minisarathi.bench.multiturn import served_model
from minisarathi.client import AsyncClient, Client, RPCError
from minisarathi.paths import default_model_dir
from minisarathi.server.auth import add_key
from minisarathi.server.protocol import UNAUTHORIZED

DEPLOY_DIR = Path(__file__).resolve().parents[2] / "deploy"
# the affinity line of each recipe, deleted for round robin
AFFINITY = {
    "nginx-msgpack.conf": "hash $remote_addr consistent;",
    "nginx-http.conf": "hash $http_x_session_id consistent;",
    "haproxy-msgpack.cfg": "balance source",
    "haproxy-http.cfg": "balance hdr(X-Session-Id)",
}
ROUND_ROBIN = {"nginx": "", "haproxy": "balance roundrobin"}
# Replicas with keys answer a msgpack `health` without one with an error: the check can only see that the
# replica answers ([1, 0, ...]), as docs/deploy.md says.
KEYED_CHECK = ("tcp-check expect binary a26f6b", "tcp-check expect binary 940100")
# The PROXY protocol on, as docs/deploy.md gives it: HAProxy sends v2 to the msgpack door and v1 to the HTTP
# door (both versions get used), its checks included; nginx's stream module sends v1 (its http proxy cannot
# send a header at all).
PROXY_PROTOCOL = {
    "haproxy-msgpack.cfg": [
        (" fall 2 rise 2", " fall 2 rise 2 send-proxy-v2 check-send-proxy"),
        ("tcp-check connect", "tcp-check connect send-proxy"),
    ],
    "haproxy-http.cfg": [(" fall 2 rise 2", " fall 2 rise 2 send-proxy check-send-proxy")],
    "nginx-msgpack.conf": [
        ("proxy_pass minisarathi_msgpack;", "proxy_pass minisarathi_msgpack;\n        proxy_protocol on;")
    ],
}
EXAMPLE_PORTS = {"msgpack": (7000, 7001, 7002), "http": (8000, 8001, 8002)}
FAIL_TIMEOUT_S = 2.0  # the nginx recipes' fail_timeout (HAProxy's rise x inter is shorter)
STREAM_MODULE = Path("/usr/lib/nginx/modules/ngx_stream_module.so")  # Debian's libnginx-mod-stream
# As the recipes say to start replicas: HAProxy's checks (inter 500ms, fall 2) take a replica out within ~1 s
# of its /ready turning 503, so it serves on for longer than that before it refuses anything.
DRAIN_DELAY_S = 2.0
ACCESS_LOG = "access.log"  # under the nginx HTTP balancer's prefix: which replica answered each request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def find_balancer(kind: str) -> str | None:
    """The nginx or haproxy executable (Debian installs them in /usr/sbin, often not on a user's PATH), or
    None; nginx counts only with its stream module (Debian: libnginx-mod-stream)."""
    path = shutil.which(kind) or shutil.which(kind, path="/usr/sbin:/usr/local/sbin")
    if path is None or kind == "haproxy":
        return path
    configure = subprocess.run([path, "-V"], capture_output=True, text=True).stderr
    if "--with-stream=dynamic" in configure:
        return path if STREAM_MODULE.is_file() else None
    return path if "--with-stream" in configure else None


def nginx_has_stream_built_in(executable: str) -> bool:
    configure = subprocess.run([executable, "-V"], capture_output=True, text=True).stderr
    return "--with-stream" in configure and "--with-stream=dynamic" not in configure


def wait_for_port(port: int, timeout: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            if proc is not None and proc.poll() is not None:  # someone else's listener: the port was taken
                raise RuntimeError(f"the process for port {port} exited with status {proc.returncode}")
            return
        except OSError:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"the process serving port {port} exited with status {proc.returncode}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing listens on port {port} after {timeout:.0f}s")
            time.sleep(0.05)


@dataclass
class Replica:
    """`minisarathi serve` with both doors on fixed ports, so that a restart comes back where the balancer
    looks."""

    msgpack_port: int
    http_port: int
    log_dir: Path
    extra_args: tuple[str, ...] = ()  # `serve` flags (a model folder first, if any)
    proc: subprocess.Popen | None = None
    starts: int = 0
    listening_since: float = 0.0  # time.monotonic() when both doors listened after the last start

    def start(self, timeout: float = 120.0) -> None:
        self.starts += 1
        repo = Path(__file__).resolve().parents[2]
        log = open(self.log_dir / f"replica-{self.msgpack_port}-{self.starts}.log", "w")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "minisarathi",
                "serve",
                *self.extra_args,
                "--port",
                str(self.msgpack_port),
                "--http-port",
                str(self.http_port),
                "--enable-prefix-caching",
                "--drain-delay",
                str(DRAIN_DELAY_S),
                "--log-level",
                "WARNING",
            ],
            stdout=subprocess.DEVNULL,
            stderr=log,
            cwd=repo,
            env={
                **os.environ,
                "PYTHONPATH": os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")])),
            },
        )
        log.close()
        wait_for_port(self.msgpack_port, timeout, self.proc)
        wait_for_port(self.http_port, timeout, self.proc)
        self.listening_since = time.monotonic()

    def wait_until_served(self, timeout: float = 60.0) -> None:
        """Until every balancer can send it requests again: its engine has generated tokens since its last
        start (one balancer took it back), and FAIL_TIMEOUT_S has passed since it listened (nginx retries a
        replica it marked down only after fail_timeout, each nginx on its own; HAProxy needs `rise`
        checks)."""
        deadline = time.monotonic() + timeout
        with Client("127.0.0.1", self.msgpack_port) as client:
            while client.stats()["tokens_generated"] == 0:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"the replica on port {self.msgpack_port} got no request in {timeout:.0f}s"
                    )
                time.sleep(0.1)
        time.sleep(max(0.0, self.listening_since + FAIL_TIMEOUT_S + 0.5 - time.monotonic()))

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM (drain), then the exit status."""
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@dataclass
class Balancer:
    """One recipe of deploy/ run in the foreground by nginx or HAProxy."""

    recipe: str  # a file name in deploy/
    door: str  # "msgpack" or "http"
    ports: tuple[int, int, int]  # listen, replica 1, replica 2
    work_dir: Path
    affinity: bool = True
    proxy_protocol: bool = False  # start each connection to a replica with a PROXY header
    keyed: bool = False  # the replicas have keys (a msgpack check sees only that they answer)
    proc: subprocess.Popen | None = None
    config_path: Path = field(init=False)

    @property
    def kind(self) -> str:
        return "nginx" if self.recipe.startswith("nginx") else "haproxy"

    def render(self, executable: str) -> str:
        text = (DEPLOY_DIR / self.recipe).read_text()
        if self.kind == "nginx" and nginx_has_stream_built_in(executable):
            text = text.replace(f"load_module {STREAM_MODULE};", "")  # as the recipe's comment says
        for example, port in zip(EXAMPLE_PORTS[self.door], self.ports):
            text = text.replace(f"127.0.0.1:{example}", f"127.0.0.1:{port}")
        if (
            self.kind == "nginx" and self.door == "http"
        ):  # which replica answered each request: see answered_by
            text = text.replace(
                "access_log off;",
                f"log_format upstreams '$upstream_addr|$upstream_status';\n"
                f"    access_log {ACCESS_LOG} upstreams;",
            )
        if self.proxy_protocol:
            if self.recipe not in PROXY_PROTOCOL:
                raise ValueError(f"{self.recipe}: nginx's http proxy cannot send a PROXY protocol header")
            for line, with_header in PROXY_PROTOCOL[self.recipe]:
                text = text.replace(line, with_header)
        if self.keyed:
            text = text.replace(*KEYED_CHECK)
        if not self.affinity:
            text = text.replace(AFFINITY[self.recipe], ROUND_ROBIN[self.kind])
            if self.kind == "haproxy":
                text = re.sub(r"\n\s*hash-type consistent", "", text)
        return text

    def start(self, executable: str, timeout: float = 30.0) -> None:
        prefix = self.work_dir / f"{self.recipe}.d"
        (prefix / "tmp").mkdir(parents=True, exist_ok=True)
        self.config_path = prefix / self.recipe
        self.config_path.write_text(self.render(executable))
        if self.kind == "nginx":
            command = [
                executable,
                "-p",
                str(prefix),
                "-c",
                str(self.config_path),
                "-e",
                "stderr",
                "-g",
                "daemon off;",
            ]
        else:
            command = [executable, "-db", "-f", str(self.config_path)]
        log = open(prefix / "balancer.log", "w")
        # its own process group: nginx's workers outlive a killed master, and kill() ends them all
        self.proc = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, cwd=prefix, start_new_session=True
        )
        log.close()
        try:
            wait_for_port(self.ports[0], timeout, self.proc)
        except (RuntimeError, TimeoutError) as e:
            raise RuntimeError(f"{self.kind} did not start with {self.recipe}: {e}\n{self.log()}") from None

    def log(self) -> str:
        return (self.work_dir / f"{self.recipe}.d" / "balancer.log").read_text(errors="replace")

    def times_marked(self, server: str, state: str) -> int:
        """How often HAProxy has logged the recipe's `server` (r1, r2) going `state` (UP or DOWN)."""
        return len(re.findall(rf"Server \S+/{server} is {state}\b", self.log()))

    def answered_by(self, port: int) -> int:
        """nginx's HTTP door: how many requests the replica on `port` answered with 200, from the access log
        (`$upstream_addr|$upstream_status`, one entry per upstream tried: the last one answered)."""
        path = self.work_dir / f"{self.recipe}.d" / ACCESS_LOG
        lines = path.read_text().splitlines() if path.exists() else []
        last = [(a.split(", ")[-1], s.split(", ")[-1]) for a, _, s in (line.partition("|") for line in lines)]
        return last.count((f"127.0.0.1:{port}", "200"))

    def kill(self) -> None:
        """SIGKILL to the balancer's every process (a crash, not a graceful stop)."""
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()


class Cluster:
    """Two replicas with both doors, and a balancer per door (nginx or HAProxy) in front of them."""

    def __init__(
        self,
        kind: str,
        affinity: bool = True,
        extra_args: tuple[str, ...] = (),
        doors: tuple[str, ...] = ("msgpack", "http"),
        proxy_protocol: bool = False,
        keyed: bool = False,
    ):
        """Two replicas, as the recipes name (add `server` lines to them for more); a balancer for each of
        `doors`; `keyed`: the replicas' extra_args give them keys."""
        self.kind = kind
        self.work_dir = Path(tempfile.mkdtemp(prefix=f"minisarathi-{kind}-"))
        self.replicas = [Replica(free_port(), free_port(), self.work_dir, extra_args) for _ in range(2)]
        suffix = "conf" if kind == "nginx" else "cfg"
        self.balancers = {
            door: Balancer(
                f"{kind}-{door}.{suffix}",
                door,
                (free_port(), *(getattr(r, f"{door}_port") for r in self.replicas)),
                self.work_dir,
                affinity,
                proxy_protocol,
                keyed,
            )
            for door in doors
        }

    @property
    def msgpack_port(self) -> int:
        return self.balancers["msgpack"].ports[0]

    @property
    def http_port(self) -> int:
        return self.balancers["http"].ports[0]

    def start(self, executable: str) -> None:
        for replica in self.replicas:
            replica.start()
        for balancer in self.balancers.values():
            balancer.start(executable)

    def restart(self, index: int, timeout: float = 60.0) -> dict:
        """Replica `index` drained (SIGTERM), started again, and back in the balancers' rotation before this
        returns: it served again (wait_until_served), each HAProxy that logged it DOWN logged it UP again (a
        server HAProxy does not count UP takes no redispatched retry), and nginx's HTTP door had it answer a
        request (nginx lets one request probe a replica it marked down; until that one is answered, it counts
        the replica down, and with the other replica draining it would answer 502 "no live upstreams"). The
        msgpack door's clients retry for longer than nginx's fail_timeout instead. Returns its exit status and
        the seconds of each phase."""
        replica, server = self.replicas[index], f"r{index + 1}"

        def signs(balancer: Balancer) -> int:  # a count that grows once the balancer sends it requests again
            return (
                balancer.times_marked(server, "UP")
                if balancer.kind == "haproxy"
                else balancer.answered_by(replica.http_port)
            )

        def taken_out(door: str) -> bool:  # nginx counts a replica down at its first failed request
            b = self.balancers[door]
            return b.kind == "nginx" or b.times_marked(server, "DOWN") > downs_before[door]

        watched = {door: b for door, b in self.balancers.items() if (b.kind, door) != ("nginx", "msgpack")}
        before = {door: signs(b) for door, b in watched.items()}
        downs_before = {door: b.times_marked(server, "DOWN") for door, b in watched.items()}
        started = time.monotonic()
        status = replica.stop()
        stopped = time.monotonic()
        replica.start()
        listening = time.monotonic()
        replica.wait_until_served(timeout)
        deadline = time.monotonic() + timeout
        # HAProxy (fall 2) takes a replica out only after two failed checks 0.5 s apart: one restarted faster
        # was never out, and no UP follows.
        while lagging := [
            door for door, b in watched.items() if taken_out(door) and signs(b) <= before[door]
        ]:
            if time.monotonic() > deadline:
                logs = "\n".join(f"{door}: {self.balancers[door].log()[-2000:]}" for door in lagging)
                raise TimeoutError(
                    f"the {self.kind} balancer of the {lagging} door did not take replica {server} "
                    f"back in {timeout:.0f}s; its log ends:\n{logs}"
                )
            time.sleep(0.1)
        return {
            "exit_status": status,
            "drain_s": stopped - started,
            "start_s": listening - stopped,
            "back_in_rotation_s": time.monotonic() - listening,
        }

    def close(self) -> None:
        for balancer in self.balancers.values():
            balancer.kill()
        running = [r for r in self.replicas if r.proc is not None and r.proc.poll() is None]
        for replica in running:  # all drain at once
            replica.proc.send_signal(signal.SIGTERM)
        for replica in running:
            try:
                replica.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                replica.kill()
        shutil.rmtree(self.work_dir, ignore_errors=True)


class ContinuousLoad:
    """Clients that send requests through a Cluster's balancers until stopped, and check every answer against
    the expected greedy outputs (`expected`: one CompletionOutput per PROMPTS entry, from offline decoding).

    msgpack: four Clients, two keeping one connection for all their requests (a draining replica closes it
    between two) and two opening one per request, streams and plain calls alternating, each from its own
    address (the address hash spreads them over the replicas). msgpack_async: one AsyncClient keeping one
    connection with a stream and a call in flight at a time (while its replica drains, one may still finish
    there while the other is refused and sent again on a new connection). http: two clients, a new session
    key each request."""

    PROMPTS = ("Once upon a time", "Tom had a red", "Lily and Tom went to the park.", "The cat")
    MAX_TOKENS = 12

    def __init__(self, cluster: Cluster, expected: list):
        self.cluster = cluster
        self.expected = {p: out.token_ids for p, out in zip(self.PROMPTS, expected)}
        self.expected_text = {p: out.text for p, out in zip(self.PROMPTS, expected)}
        self.stop = threading.Event()
        self.done = {"msgpack": 0, "msgpack_async": 0, "http": 0}
        self.failures: list[str] = []
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._msgpack, args=(i, i % 2 == 0)) for i in range(4)]
        self._threads += [threading.Thread(target=lambda: asyncio.run(self._msgpack_async(4)))]
        self._threads += [threading.Thread(target=self._http, args=(i,)) for i in range(2)]

    def __enter__(self):
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for thread in self._threads:
            thread.join(timeout=120)

    def _record(self, door: str, failure: str | None):
        with self._lock:
            if failure is None:
                self.done[door] += 1
            else:
                self.failures.append(f"{door}: {failure}")

    def _msgpack(self, i: int, persistent: bool):
        address = ("127.0.0.1", self.cluster.msgpack_port)
        source = (f"127.0.0.{20 + i}", 0)
        client = Client(*address, source_address=source, retries=6) if persistent else None
        n = 0
        while not self.stop.is_set():
            prompt = self.PROMPTS[n % len(self.PROMPTS)]
            n += 1
            try:
                c = client or Client(*address, source_address=source, retries=6)
                if n % 2:
                    stream = c.generate_stream(prompt, max_tokens=self.MAX_TOKENS, temperature=0)
                    list(stream)
                    result = stream.result
                else:
                    result = c.generate(prompt, max_tokens=self.MAX_TOKENS, temperature=0)
                if client is None:
                    c.close()
                ok = result.token_ids == self.expected[prompt]
                self._record("msgpack", None if ok else f"{prompt!r} gave {result.token_ids}")
            except Exception as e:  # counted: a failed request is what the run measures
                self._record("msgpack", f"{type(e).__name__}: {e}")
        if client is not None:
            client.close()

    async def _msgpack_async(self, i: int):
        try:
            async with AsyncClient(
                "127.0.0.1", self.cluster.msgpack_port, source_address=(f"127.0.0.{20 + i}", 0), retries=6
            ) as client:
                await asyncio.gather(
                    self._async_requests(client, stream=True), self._async_requests(client, stream=False)
                )
        except Exception as e:  # counted, as above
            self._record("msgpack_async", f"{type(e).__name__}: {e}")

    async def _async_requests(self, client: AsyncClient, stream: bool):
        n = 0
        while not self.stop.is_set():
            prompt = self.PROMPTS[n % len(self.PROMPTS)]
            n += 1
            try:
                if stream:
                    request = client.generate_stream(prompt, max_tokens=self.MAX_TOKENS, temperature=0)
                    async for _ in request:
                        pass
                    result = request.result
                else:
                    result = await client.generate(prompt, max_tokens=self.MAX_TOKENS, temperature=0)
                ok = result.token_ids == self.expected[prompt]
                self._record("msgpack_async", None if ok else f"{prompt!r} gave {result.token_ids}")
            except Exception as e:  # counted, as above
                self._record("msgpack_async", f"{type(e).__name__}: {e}")

    def _http(self, i: int):
        model = served_model("127.0.0.1", self.cluster.http_port)
        n = 0
        while not self.stop.is_set():
            prompt = self.PROMPTS[n % len(self.PROMPTS)]
            n += 1
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.cluster.http_port, timeout=120)
                conn.request(
                    "POST",
                    "/v1/completions",
                    json.dumps(
                        {"model": model, "prompt": prompt, "max_tokens": self.MAX_TOKENS, "temperature": 0}
                    ),
                    {"Content-Type": "application/json", "X-Session-Id": f"load-{i}-{n}"},
                )
                response = conn.getresponse()
                body = response.read()
                conn.close()
                if response.status != 200:
                    self._record("http", f"HTTP {response.status}: {body[:200]!r}")
                    continue
                text = json.loads(body)["choices"][0]["text"]
                self._record(
                    "http", None if text == self.expected_text[prompt] else f"{prompt!r} gave {text!r}"
                )
            except Exception as e:  # counted, as above
                self._record("http", f"{type(e).__name__}: {e}")


# Clients behind the balancer: a guesser per door (the doors share an address's backoff, so one guesser
# would find the second door already slowed by the first), and a key holder.
GUESSERS, KEY_HOLDER = {"msgpack": "127.0.0.40", "http": "127.0.0.42"}, "127.0.0.41"


def brute_force_behind(kind: str, executable: str, work_dir: Path, proxy_protocol: bool, guesses: int = 12):
    """Two replicas with a key (and, with proxy_protocol, --proxy-protocol-from the balancer's 127.0.0.1)
    behind round-robin balancers: per door, `guesses` wrong keys from its GUESSERS address, each on a new
    connection, then {"key_holder_s": a KEY_HOLDER's auth and 2-token generate (None: refused),
    "next_guess_s": the guesser's next wrong key}.
    nginx: the msgpack door only (its http proxy sends no PROXY header)."""
    keys = work_dir / "keys.toml"
    secret = add_key(keys, "alice")
    doors = ("msgpack",) if kind == "nginx" else ("msgpack", "http")
    trust = ("--proxy-protocol-from", "127.0.0.1") if proxy_protocol else ()
    cluster = Cluster(
        kind,
        affinity=False,
        extra_args=("--keys-file", str(keys), *trust),
        doors=doors,
        proxy_protocol=proxy_protocol,
        keyed=True,
    )
    results = {}
    try:
        cluster.start(executable)
        for door in doors:
            port = cluster.balancers[door].ports[0]
            for _ in range(guesses):
                _wrong_key_s(door, port)
            results[door] = {
                "key_holder_s": _key_holder_s(door, port, secret),
                "next_guess_s": _wrong_key_s(door, port),
            }
    finally:
        cluster.close()
    return results


def _wrong_key_s(door: str, port: int) -> float:
    """Seconds a wrong key from the door's guesser takes to be refused, on a new connection."""
    start, guesser = time.monotonic(), GUESSERS[door]
    if door == "msgpack":
        with socket.create_connection(("127.0.0.1", port), timeout=30, source_address=(guesser, 0)) as sock:
            sock.sendall(msgpack.packb([0, 0, "auth", ["wrong"]]))
            answer = msgpack.unpackb(sock.recv(1 << 16))
        if answer[2]["code"] != UNAUTHORIZED:
            raise RuntimeError(f"a wrong key was answered {answer}")
    else:
        _http_completion(port, guesser, "wrong", want=(401, 429))  # 429: its backoff queue was full
    return time.monotonic() - start


def _key_holder_s(door: str, port: int, key: str) -> float | None:
    """Seconds until KEY_HOLDER's 2 tokens came back, or None if it was refused (its address's backoff)."""
    start = time.monotonic()
    try:
        if door == "msgpack":
            with Client("127.0.0.1", port, api_key=key, source_address=(KEY_HOLDER, 0), timeout=60) as c:
                c.generate("Zoo", max_tokens=2)
        elif _http_completion(port, KEY_HOLDER, key, want=(200, 429)) == 429:
            return None
    except RPCError as e:
        if e.code != UNAUTHORIZED:
            raise
        return None
    return time.monotonic() - start


def _http_completion(port: int, source: str, key: str, want: tuple[int, ...]) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60, source_address=(source, 0))
    body = {"model": default_model_dir().name, "prompt": "Zoo", "max_tokens": 2}  # the replicas' model
    conn.request("POST", "/v1/completions", json.dumps(body), {"Authorization": f"Bearer {key}"})
    response = conn.getresponse()
    answer = response.read()
    conn.close()
    if response.status not in want:
        raise RuntimeError(f"HTTP {response.status}, not {want}: {answer[:200]!r}")
    return response.status
