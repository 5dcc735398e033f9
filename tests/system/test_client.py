"""`minisarathi serve` + `minisarathi client` as processes, the API key, and shutdown on SIGTERM."""

import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import msgpack
import pytest
from test_server import REPO, RawConnection, launch_server, offline_greedy, wait_until_idle

from minisarathi.cli_args import API_KEY_ENV, read_api_key
from minisarathi.client import Client, RPCError
from minisarathi.server.protocol import ABORTED, INVALID_PARAMS, UNAUTHORIZED

KEY = "s3cret-key-for-tests"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    key_file = tmp_path_factory.mktemp("key") / "key.txt"
    key_file.write_text(KEY + "\n")
    with launch_server(
        "--api-key-file", str(key_file), "--log-level", "INFO", "--shutdown-grace", "0.5"
    ) as s:
        s.key_file = key_file
        yield s


def run_client(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "minisarathi", "client", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )


def test_cli_client_prints_the_offline_greedy_text(server):
    prompt = "Once upon a time"
    want = offline_greedy([prompt], [24])[0].text
    plain = run_client(
        prompt, "--max-tokens", "24", "--port", str(server.port), "--api-key-file", str(server.key_file)
    )
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout == prompt + want + "\n"
    streamed = run_client(
        prompt,
        "--max-tokens",
        "24",
        "--stream",
        "--unix-socket",
        server.unix_socket,
        "--api-key-file",
        str(server.key_file),
    )
    assert streamed.returncode == 0, streamed.stderr
    assert streamed.stdout == prompt + want + "\n"


def test_cli_client_without_the_key_fails_cleanly(server):
    result = run_client("Zoo", "--port", str(server.port))
    assert result.returncode == 1 and "unauthorized" in result.stderr


def test_every_call_is_unauthorized_until_auth(server):
    with Client("127.0.0.1", server.port) as client:
        for method, params in (
            ("health", []),
            ("stats", []),
            ("tokenize", ["x"]),
            ("generate", [{"prompt": "Zoo"}]),
            ("no_such_method", []),
        ):  # not even which methods exist
            with pytest.raises(RPCError) as info:
                client.call(method, *params)
            assert info.value.code == UNAUTHORIZED
        with pytest.raises(RPCError) as info:
            client.auth("wrong")
        assert info.value.code == UNAUTHORIZED
        assert client.auth(KEY) is True
        assert client.generate("Zoo", max_tokens=3).completion_tokens == 3
    with Client(unix_socket=server.unix_socket, api_key=KEY) as client:
        assert client.health()["status"] == "ok"
    assert KEY not in Path(server.log_path).read_text()
    wait_until_idle(server, api_key=KEY)


def test_auth_as_a_notification_and_as_bin(server):
    conn = RawConnection(server)
    conn.send([2, "auth", ["wrong"]], [0, 1, "health", []])  # no reply to a notification, even a failed one
    assert conn.receive()[2]["code"] == UNAUTHORIZED
    conn.sock.sendall(msgpack.packb([2, b"auth", [KEY.encode()]], use_bin_type=True))
    conn.send([0, 2, "health", []])
    assert conn.receive()[:3] == [1, 2, None]
    conn.close()


def test_api_key_from_file_or_environment(tmp_path, monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert read_api_key(None) is None
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert read_api_key(None) == "from-env"
    (tmp_path / "k").write_text("from-file\n")
    assert read_api_key(str(tmp_path / "k")) == "from-file"
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="api-key-file"):
        read_api_key(str(tmp_path / "empty"))


def test_sigterm_ends_in_flight_requests_and_exits_0():
    # The grace must stay well under the time 4 streams of 500 tokens take (~0.2 s on the bundled model on the
    # 2-core VM with the native decode attention; 0.3 s let them all finish there).
    with launch_server("--shutdown-grace", "0.05") as server:
        client = Client("127.0.0.1", server.port)
        streams = [
            client.generate_stream("Once upon a time", max_tokens=500, ignore_eos=True) for _ in range(4)
        ]
        first = next(iter(streams[0]))
        assert first.token_ids
        # A client that pipelines requests and reads nothing must not hold the shutdown up either.
        deaf = socket.socket()
        deaf.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        deaf.connect(("127.0.0.1", server.port))
        flood = b"".join(msgpack.packb([0, i, "model_info", []]) for i in range(30_000))
        threading.Thread(target=_send_until_closed, args=(deaf, flood), daemon=True).start()
        server.proc.send_signal(signal.SIGTERM)
        outcomes = []
        for stream in streams:
            try:
                list(stream)
                outcomes.append(stream.result.finish_reason)
            except RPCError as e:
                outcomes.append(e.code)
        assert set(outcomes) <= {"length", ABORTED} and ABORTED in outcomes
        client.close()
        assert server.proc.wait(timeout=30) == 0  # launch_server checks the same on exit
        deaf.close()


def _send_until_closed(sock: socket.socket, data: bytes):
    try:
        sock.sendall(data)
    except OSError:
        pass  # the server went away first


def test_async_and_sync_clients_agree(server):
    import asyncio

    from minisarathi.client import AsyncClient

    async def run():
        async with AsyncClient("127.0.0.1", server.port, api_key=KEY) as client:
            results = await asyncio.gather(
                *[
                    client.generate(p, max_tokens=12, temperature=0)
                    for p in ("Tom had a red", "Zoo", "The cat")
                ]
            )
            stream = client.generate_stream("Zoo", max_tokens=12)
            async for _ in stream:
                break
            await stream.aclose()  # leaving early aborts it
            return results

    async_results = asyncio.run(run())
    with Client("127.0.0.1", server.port, api_key=KEY) as client:
        sync_results = [
            client.generate(p, max_tokens=12, temperature=0) for p in ("Tom had a red", "Zoo", "The cat")
        ]
    assert [r.token_ids for r in async_results] == [r.token_ids for r in sync_results]
    wait_until_idle(server, api_key=KEY)


def test_idle_connection_is_closed_and_engine_rejections_are_invalid_params():
    with launch_server(
        "--idle-timeout", "0.3", "--unread-timeout", "0.3", "--num-kv-blocks", "4", "--block-size", "16"
    ) as server:
        idle = socket.create_connection(("127.0.0.1", server.port))
        idle.settimeout(30)
        assert idle.recv(1) == b""  # closed by the server, not by the 30 s timeout
        idle.close()
        # So is one that leaves its answers unread --unread-timeout long (the server stopped reading its
        # requests).
        deaf = socket.socket()
        deaf.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        deaf.connect(("127.0.0.1", server.port))
        flood = b"".join(msgpack.packb([0, i, "model_info", []]) for i in range(30_000))
        threading.Thread(target=_send_until_closed, args=(deaf, flood), daemon=True).start()
        for _ in range(10_000):
            with Client("127.0.0.1", server.port) as client:
                if client.stats()["connections"] == 1:  # just this one
                    break
        else:
            pytest.fail("a connection that reads nothing was never closed")
        deaf.close()
        with Client("127.0.0.1", server.port) as client:
            with pytest.raises(RPCError) as info:  # 4 blocks of 16 tokens cannot hold 5 + 100 tokens
                client.generate("Once upon a time", max_tokens=100)
            assert info.value.code == INVALID_PARAMS and "max_tokens" in info.value.message
            assert client.generate("Once upon a time", max_tokens=20).completion_tokens == 20
