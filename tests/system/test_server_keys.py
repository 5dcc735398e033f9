"""Named keys with quotas (a keys file, SIGHUP reload, per-key stats) and TLS, on a real server process."""

import asyncio
import http.client
import importlib.util
import json
import os
import re
import signal
import ssl
import subprocess
import sys
import time

import pytest
import trustme
from test_server import REPO, launch_server

from minisarathi.client import AsyncClient, Client, RPCError
from minisarathi.server.auth import add_key
from minisarathi.server.protocol import INVALID_PARAMS, RATE_LIMITED, UNAUTHORIZED


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.toml"
    secrets = {
        "alice": add_key(path, "alice", rpm=3, max_tokens=50),
        "bob": add_key(path, "bob", tpm=200),
        "carol": add_key(path, "carol", concurrent=1),
        "erin": add_key(path, "erin", rpm=2),
    }
    with launch_server("--keys-file", str(path), *HTTP_ARGS, *KEY_LABELS) as server:
        server.keys_path, server.secrets = path, secrets
        server.http_port = http_port(server)
        yield server


HTTP_ARGS = ("--http-port", "0") if importlib.util.find_spec("aiohttp") else ()
KEY_LABELS = ("--metrics-key-labels",) if HTTP_ARGS else ()


def http_port(server, scheme: str = "http") -> int | None:
    """The HTTP door's port: the line after launch_server's two (TCP, then Unix socket), which names its
    scheme."""
    if not HTTP_ARGS:
        return None
    line = server.proc.stdout.readline()
    assert line.startswith(f"minisarathi serving on {scheme}://"), line
    return int(re.match(r"minisarathi serving on https?://[\d.]+:(\d+)", line).group(1))


def post(port: int, path: str, body: dict, key: str | None, context: ssl.SSLContext | None = None):
    connection = (
        http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        if context is None
        else http.client.HTTPSConnection("127.0.0.1", port, timeout=60, context=context)
    )
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    connection.request("POST", path, json.dumps(body), headers)
    response = connection.getresponse()
    return response.status, dict(response.getheaders()), json.loads(response.read())


def connect(server, name: str) -> Client:
    return Client("127.0.0.1", server.port, api_key=server.secrets[name], timeout=60)


def test_requests_per_minute_then_rate_limited_with_retry_after(keyed):
    with connect(keyed, "alice") as alice:
        for _ in range(3):
            assert alice.generate("Zoo", max_tokens=2).completion_tokens == 2
        with pytest.raises(RPCError) as info:
            alice.generate("Zoo", max_tokens=2)
        assert info.value.code == RATE_LIMITED and info.value.name == "rate_limited"
        assert 0 < info.value.retry_after_s <= 20  # one request comes back every 20 s
        with pytest.raises(RPCError) as info:  # the key's max_tokens cap, checked first
            alice.generate("Zoo", max_tokens=51)
        assert (
            info.value.code == INVALID_PARAMS
            and "max_tokens must be <= 50 for this key" in info.value.message
        )
        with connect(keyed, "bob") as bob:  # other keys are not affected
            assert bob.generate("Zoo", max_tokens=2).completion_tokens == 2


def test_tokens_per_minute_are_charged_at_admission_and_refunded_at_finish(keyed):
    with connect(keyed, "bob") as bob:
        # 4 prompt tokens + max_tokens 150 charged; stopping at "," early refunds what was not generated
        first = bob.generate("Once upon a time", max_tokens=150, stop=[","], temperature=0)
        assert first.finish_reason == "stop" and first.completion_tokens < 20
        second = bob.generate(
            "Once upon a time", max_tokens=150, stop=[","], temperature=0
        )  # fits after refund
        assert second.token_ids == first.token_ids
        with pytest.raises(RPCError) as info:  # 155 + 155 + 155 - refunds: no room for 150 more ...
            for _ in range(3):
                bob.generate("Once upon a time", max_tokens=150, ignore_eos=True)
        assert info.value.code == RATE_LIMITED and info.value.retry_after_s > 0
        with pytest.raises(RPCError) as info:  # ... and more than a minute's worth can never be
            bob.generate([1] * 60, max_tokens=150)
        assert info.value.code == INVALID_PARAMS and "tokens per minute (200)" in info.value.message


def test_concurrent_requests_per_key(keyed):
    async def run():
        async with AsyncClient("127.0.0.1", keyed.port, api_key=keyed.secrets["carol"]) as carol:
            results = await asyncio.gather(
                carol.generate("Zoo", max_tokens=30, ignore_eos=True),
                carol.generate("Zoo", max_tokens=30, ignore_eos=True),
                return_exceptions=True,
            )
            return results, await carol.generate("Zoo", max_tokens=2)

    (one, two), after = asyncio.run(run())
    assert one.completion_tokens == 30 and isinstance(two, RPCError) and two.code == RATE_LIMITED
    assert after.completion_tokens == 2


@pytest.mark.skipif(not HTTP_ARGS, reason="the http extra is not installed")
def test_the_http_door_checks_the_same_keys_and_quotas(keyed):
    body = {"model": "stories260K", "prompt": "Once upon a time", "max_tokens": 4}
    for key in (None, "ms-wrong"):
        status, _, error = post(keyed.http_port, "/v1/completions", body, key)
        assert status == 401 and error["error"]["code"] == "invalid_api_key"
    erin = keyed.secrets["erin"]
    for _ in range(2):
        status, _, result = post(keyed.http_port, "/v1/completions", body, erin)
        assert status == 200 and result["usage"]["completion_tokens"] == 4
    status, headers, error = post(keyed.http_port, "/v1/completions", body, erin)
    assert status == 429 and error["error"]["code"] == "rate_limit_exceeded"
    assert 1 <= int(headers["Retry-After"]) <= 30
    with connect(keyed, "erin") as c:  # one quota for both doors
        with pytest.raises(RPCError) as info:
            c.generate("Zoo", max_tokens=2)
        assert info.value.code == RATE_LIMITED
    status, _, error = post(
        keyed.http_port, "/v1/completions", {**body, "max_tokens": 51}, keyed.secrets["alice"]
    )
    assert status == 400 and "max_tokens must be <= 50 for this key" in error["error"]["message"]
    from prometheus_client.parser import text_string_to_metric_families

    connection = http.client.HTTPConnection("127.0.0.1", keyed.http_port, timeout=60)
    connection.request("GET", "/metrics")
    samples = {
        (s.name, s.labels.get("key")): s.value
        for family in text_string_to_metric_families(connection.getresponse().read().decode())
        for s in family.samples
    }
    assert samples[("minisarathi:key_requests_total", "erin")] == 2
    assert samples[("minisarathi:key_rate_limited_total", "erin")] == 2  # one per door
    assert samples[("minisarathi:key_generation_tokens_total", "erin")] == 8
    assert samples[("minisarathi:auth_failures_total", None)] >= 2
    assert {key for name, key in samples if name == "minisarathi:key_requests_total"} == set(keyed.secrets)


def test_stats_count_per_key_by_name(keyed):
    with connect(keyed, "carol") as carol:
        per_key = carol.stats()["keys"]
    assert set(per_key) == {"alice", "bob", "carol", "erin"}
    assert per_key["alice"]["requests"] >= 3 and per_key["alice"]["rate_limited"] >= 1
    assert per_key["bob"]["prompt_tokens"] > 0 and per_key["carol"]["inflight"] == 0


def test_sighup_reloads_the_keys_file_without_dropping_connections(keyed):
    alice = connect(keyed, "alice")
    bob = connect(keyed, "bob")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "minisarathi",
            "keys",
            "add",
            "dave",
            "--file",
            str(keyed.keys_path),
            "--rpm",
            "100",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert result.returncode == 0, result.stderr
    dave_secret = result.stdout.strip()
    assert dave_secret.startswith("ms-") and dave_secret not in keyed.keys_path.read_text()
    # bob is removed in the same edit
    text = keyed.keys_path.read_text()
    blocks = text.split("[[keys]]")
    keyed.keys_path.write_text("[[keys]]".join(b for b in blocks if 'name = "bob"' not in b))
    keyed.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 30
    while True:
        try:
            with Client("127.0.0.1", keyed.port, api_key=dave_secret) as dave:
                assert dave.generate("Zoo", max_tokens=2).completion_tokens == 2
            break
        except RPCError as e:
            assert e.code == UNAUTHORIZED and time.monotonic() < deadline
            time.sleep(0.1)
    assert alice.health()["status"] == "ok"  # the same connection, still open and authenticated
    with pytest.raises(RPCError) as info:  # a removed key's connection stays, unauthenticated
        bob.health()
    assert info.value.code == UNAUTHORIZED
    alice.close()
    bob.close()


# ------------------------------------------------------------------ TLS


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    ca = trustme.CA()
    folder = tmp_path_factory.mktemp("tls")
    server_cert = ca.issue_cert("127.0.0.1", "localhost")
    server_cert.cert_chain_pems[0].write_to_path(str(folder / "server.pem"))
    server_cert.private_key_pem.write_to_path(str(folder / "server.key"))
    ca.cert_pem.write_to_path(str(folder / "ca.pem"))
    return ca, folder


def test_tls_door_with_our_clients_and_the_cli(tls_files):
    ca, folder = tls_files
    context = ssl.create_default_context(cafile=str(folder / "ca.pem"))
    with launch_server(
        "--tls-cert", str(folder / "server.pem"), "--tls-key", str(folder / "server.key"), *HTTP_ARGS
    ) as server:
        with Client("127.0.0.1", server.port, tls=context) as c:
            expected = c.generate("Once upon a time", max_tokens=8, temperature=0)
        if HTTP_ARGS:  # the HTTP door speaks TLS too
            status, _, result = post(
                http_port(server, "https"),
                "/v1/completions",
                {"model": "stories260K", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0},
                None,
                context,
            )
            assert status == 200 and result["choices"][0]["text"] == expected.text

        async def run():
            async with AsyncClient("127.0.0.1", server.port, tls=context) as c:
                return await c.generate("Once upon a time", max_tokens=8, temperature=0)

        assert asyncio.run(run()).token_ids == expected.token_ids
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "minisarathi",
                "client",
                "Once upon a time",
                "--port",
                str(server.port),
                "--tls-ca",
                str(folder / "ca.pem"),
                "--max-tokens",
                "8",
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        assert result.returncode == 0 and result.stdout.strip() == "Once upon a time" + expected.text
        with pytest.raises(ssl.SSLError):  # a client that does not trust the CA
            Client("127.0.0.1", server.port, tls=ssl.create_default_context())
        with pytest.raises((ConnectionError, RPCError, OSError)):  # plain msgpack at a TLS door
            with Client("127.0.0.1", server.port, timeout=10) as plain:
                plain.health()
        wait_until_idle_tls(server, context)


def wait_until_idle_tls(server, context):
    with Client("127.0.0.1", server.port, tls=context) as c:
        stats = c.stats()
    assert stats["pending_requests"] == 0 and stats["kv_blocks_used"] == 0


def test_tls_client_certificates(tls_files):
    ca, folder = tls_files
    with launch_server(
        "--tls-cert",
        str(folder / "server.pem"),
        "--tls-key",
        str(folder / "server.key"),
        "--tls-client-ca",
        str(folder / "ca.pem"),
    ) as server:
        without = ssl.create_default_context(cafile=str(folder / "ca.pem"))
        with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
            with Client("127.0.0.1", server.port, tls=without, timeout=10) as c:
                c.health()  # TLS 1.3 reports a refused client certificate at the first read
        with_cert = ssl.create_default_context(cafile=str(folder / "ca.pem"))
        ca.issue_cert("client.example").configure_cert(with_cert)
        with Client("127.0.0.1", server.port, tls=with_cert) as c:
            assert c.generate("Zoo", max_tokens=2).completion_tokens == 2
