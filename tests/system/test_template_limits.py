"""A hostile chat template (a nested range(100000) loop, lipsum(50000), a 100 MB string) gets a clear 400
within --template-timeout, while both doors keep serving, another client's stream runs to its end, and
SIGTERM still stops the server at once (a real server process)."""

import contextlib
import http.client
import importlib.util
import json
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from minisarathi.client import Client

pytestmark = pytest.mark.skipif(not importlib.util.find_spec("aiohttp"), reason="the http extra is needed")
REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 0.5  # --template-timeout
# Hostile only for some messages, so one server also renders normal ones. Each branch computes from the
# messages: Jinja folds constant expressions when it compiles, which would make every render slow.
TEMPLATE = """{% for m in messages %}
{% if m.content == 'loop' %}{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}
{% elif m.content == 'lipsum' %}{{ lipsum(50000 + messages|length) }}
{% elif m.content == 'big' %}{{ m.content[:1] * (10**8 + messages|length) }}
{% else %}<|user|>{{ m.content }}
{% endif %}{% endfor %}<|assistant|>"""


@contextlib.contextmanager
def launch(*args: str):
    """`minisarathi serve` with msgpack and HTTP doors; yields (proc, msgpack port, HTTP port, log path).
    Killed at exit if SIGTERM did not stop it within 10 s (a frozen loop ignores SIGTERM)."""
    with tempfile.TemporaryDirectory() as tmp:
        template, log_path = Path(tmp) / "template.jinja", Path(tmp) / "server.log"
        template.write_text(TEMPLATE)
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "minisarathi", "serve", "--port", "0", "--http-port", "0"]
                + ["--chat-template", str(template), "--template-timeout", str(TIMEOUT_S), *args],
                cwd=REPO,
                stdout=subprocess.PIPE,
                stderr=log,
                env={**os.environ, "PYTHONPATH": str(REPO)},
            )
        try:
            output, ports = b"", []
            deadline = time.monotonic() + 120
            while len(ports) < 2 and time.monotonic() < deadline:
                if select.select([proc.stdout], [], [], 1.0)[0]:
                    piece = os.read(proc.stdout.fileno(), 4096)  # unbuffered: select stays truthful
                    if not piece:
                        break
                    output += piece
                    ports = re.findall(rb"minisarathi serving on (?:http://)?[\d.]+:(\d+)", output)
            assert len(ports) == 2, log_path.read_text()
            yield proc, int(ports[0]), int(ports[1]), log_path
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def chat(port: int, content: str, timeout: float = 30.0):
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 4}
    connection.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = connection.getresponse()
    return response.status, json.loads(response.read())


def health_during(port: int, busy: threading.Thread) -> float:
    """The slowest msgpack `health` round trip while `busy` runs."""
    slowest = 0.0
    with Client("127.0.0.1", port, timeout=30) as client:
        while busy.is_alive():
            start = time.monotonic()
            assert client.health()["status"] == "ok"
            slowest = max(slowest, time.monotonic() - start)
            time.sleep(0.01)
    return slowest


def in_thread(fn, *args) -> tuple[threading.Thread, dict]:
    out = {}
    thread = threading.Thread(target=lambda: out.setdefault("result", fn(*args)), daemon=True)
    thread.start()
    return thread, out


@pytest.fixture(scope="module")
def server():
    with launch() as s:
        yield s


@pytest.mark.parametrize("content", ["loop", "lipsum", "big"])
def test_a_runaway_render_is_a_400_and_freezes_no_one(server, content):
    proc, port, http_port, log_path = server
    with Client("127.0.0.1", port, timeout=30) as client:
        want = client.generate("Once upon", max_tokens=60, temperature=0, ignore_eos=True)
        # another client's stream runs while the template runs away
        stream = client.generate_stream("Once upon", max_tokens=60, temperature=0, ignore_eos=True)
        started = time.monotonic()
        rendering, answer = in_thread(chat, http_port, content)
        slowest = health_during(port, rendering)
        rendering.join()
        elapsed = time.monotonic() - started
        streamed = [piece for chunk in stream for piece in chunk.token_ids]
    status, body = answer["result"]
    assert status == 400, body
    message = body["error"]["message"]
    assert body["error"]["param"] == "messages"
    assert message.startswith("the chat template refused the messages: "), message
    if content == "big":
        assert "exceeds" in message or "more than" in message, message
    else:
        assert f"rendering took more than {TIMEOUT_S:g}s" in message, message
    assert elapsed < TIMEOUT_S + 5, elapsed  # the limit, plus the stream's own time on a shared machine
    assert slowest < 1.0, slowest  # a frozen loop: the whole render
    assert streamed == want.token_ids  # not lost, not cut
    assert "Traceback" not in log_path.read_text()
    # the worker was replaced: a normal render works at once
    status, body = chat(http_port, "Tell me a story.")
    assert status == 200, body


def test_sigterm_stops_the_server_during_a_runaway_render():
    with launch() as (proc, port, http_port, log_path):
        rendering, _ = in_thread(chat, http_port, "loop", 5.0)
        time.sleep(0.2)  # the render is under way
        proc.send_signal(signal.SIGTERM)
        start = time.monotonic()
        try:
            rc = proc.wait(timeout=8)
        except subprocess.TimeoutExpired:
            rc = None
        assert rc == 0, log_path.read_text()
        assert time.monotonic() - start < 7  # shutdown grace (5 s) at most
        rendering.join(10)
        assert "Traceback" not in log_path.read_text()
