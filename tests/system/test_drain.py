"""Draining on SIGTERM as a load balancer needs it, and the clients' reconnect-and-retry.

The listener closes first (a balancer's next connection or TCP check fails over), idle connections close at
once, in-flight streams finish within the grace period; a Client or AsyncClient whose connection closed before
an answer began, or whose request the draining server refused, reconnects and sends the request again, and one
whose stream had started raises. The restart tests start the second server on the first one's port, as a
replica restarted in place (or another replica behind a balancer) takes the traffic.
"""

import asyncio
import contextlib
import http.client
import json
import signal
import socket
import threading
import time

import pytest
from test_server import launch_server, offline_greedy

from minisarathi.client import AsyncClient, Client, RPCError
from minisarathi.server.protocol import ABORTED

RESTART_RETRIES = 40  # ~37 s of backoff (capped at 1 s a try): a second server starts well within it


def _connect_fails(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except ConnectionRefusedError:
        return True
    except ConnectionResetError:  # accepted in the instant before the close, then dropped: not refused yet
        return False
    return False


def test_sigterm_closes_listener_and_idle_connections_first_and_lets_streams_finish():
    with launch_server("--shutdown-grace", "30") as server:
        idle = Client("127.0.0.1", server.port, retries=0)
        assert idle.health()["status"] == "ok"
        busy = Client("127.0.0.1", server.port)
        stream = busy.generate_stream("Once upon a time", max_tokens=200, ignore_eos=True, temperature=0)
        chunks = iter(stream)
        next(chunks)
        server.proc.send_signal(signal.SIGTERM)
        _wait_until_refused(server.port)  # the listener goes first ...
        assert server.proc.poll() is None  # ... while the stream is still being served
        with pytest.raises(ConnectionError):  # the idle connection was closed, and no retry is allowed
            idle.health()
        list(chunks)
        assert stream.result.finish_reason == "length" and stream.result.completion_tokens == 200
        busy.close()
        assert server.proc.wait(timeout=30) == 0


def test_client_retries_a_request_whose_connection_closed_before_an_answer():
    """A one-connection proxy that drops the first connection after reading a request (as a draining replica
    closes an idle connection the request raced with), then forwards the next one: the call succeeds once."""
    with launch_server() as server:
        listener = socket.create_server(("127.0.0.1", 0))
        accepted = []

        def proxy():
            first, _ = listener.accept()
            accepted.append(first.recv(65536))
            first.close()  # read, never answered: not accepted
            second, _ = listener.accept()
            upstream = socket.create_connection(("127.0.0.1", server.port))
            for a, b in ((second, upstream), (upstream, second)):
                threading.Thread(target=_pump, args=(a, b), daemon=True).start()

        threading.Thread(target=proxy, daemon=True).start()
        with Client("127.0.0.1", listener.getsockname()[1], retries=2) as client:
            result = client.generate("Once upon a time", max_tokens=5, temperature=0)
        assert result.completion_tokens == 5 and accepted and accepted[0]
        listener.close()


def test_a_stream_that_started_is_not_retried():
    # 1 ms of grace: the 399 tokens left take ~100x longer even on an idle machine, so the stream is cut
    with launch_server("--shutdown-grace", "0.001") as server:
        with Client("127.0.0.1", server.port) as client:
            stream = iter(client.generate_stream("Once upon a time", max_tokens=400, ignore_eos=True))
            next(stream)
            server.proc.send_signal(signal.SIGTERM)  # the grace period ends the stream half way
            with pytest.raises(RPCError) as info:  # the server's abort, not a retry that repeats text
                list(stream)
        assert info.value.code == ABORTED


def test_repeated_sigterms_while_shutting_down_still_exit_cleanly():
    """A supervisor may signal again while the server drains (or as the test harness does, on its way out):
    the loop's close used to restore the default action, and a late SIGTERM then killed the exiting
    process."""
    with launch_server() as server:
        server.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 60
        while server.proc.poll() is None and time.monotonic() < deadline:
            server.proc.send_signal(signal.SIGTERM)
            time.sleep(0.001)
        assert server.proc.wait(timeout=1) == 0


def _wait_until_refused(port: int) -> None:
    deadline = time.monotonic() + 10
    while not _connect_fails(port):
        assert time.monotonic() < deadline, "the listener stayed open while draining"
        time.sleep(0.02)


def _pump(source: socket.socket, sink: socket.socket):
    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:
        pass
    finally:
        sink.close()


def test_sigterm_closes_the_http_listener_while_its_stream_finishes_and_ready_turns_503():
    pytest.importorskip("aiohttp")
    from test_http import API_KEY, launch

    with launch("--http-port", "0", "--metrics-port", "0", "--shutdown-grace", "30") as server:
        conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
        conn.request(
            "POST",
            "/v1/completions",
            json.dumps(
                {
                    "model": "stories260K",
                    "prompt": "Once upon a time",
                    "max_tokens": 200,
                    "ignore_eos": True,
                    "temperature": 0,
                    "stream": True,
                }
            ),
            {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"},
        )
        response = conn.getresponse()
        assert response.status == 200 and response.readline().startswith(b"data:")
        server.proc.send_signal(signal.SIGTERM)
        _wait_until_refused(server.http_port)
        probe = http.client.HTTPConnection("127.0.0.1", server.metrics_port, timeout=10)
        probe.request("GET", "/ready")
        assert probe.getresponse().status == 503
        body = response.read()
        assert body.rstrip().endswith(b"data: [DONE]") and b'"finish_reason":"length"' in body.replace(
            b" ", b""
        )
        assert server.proc.wait(timeout=30) == 0


def test_with_a_drain_delay_ready_turns_503_while_requests_are_still_served():
    """--drain-delay: after SIGTERM the HTTP door's /ready answers 503 at once (a balancer's checks take the
    replica out), while a new completion is still answered in full; only then does the listener close."""
    pytest.importorskip("aiohttp")
    from test_http import API_KEY, launch

    with launch("--http-port", "0", "--drain-delay", "3", "--shutdown-grace", "30") as server:
        server.proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        deadline = signalled + 10
        while True:
            probe = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=10)
            probe.request("GET", "/ready")
            if probe.getresponse().status == 503:
                break
            assert time.monotonic() < deadline, "/ready never turned 503"
            time.sleep(0.05)
        conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
        conn.request(
            "POST",
            "/v1/completions",
            json.dumps(
                {"model": "stories260K", "prompt": "Tom had a red", "max_tokens": 8, "temperature": 0}
            ),
            {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"},
        )
        response = conn.getresponse()
        assert response.status == 200, response.read()
        answered = time.monotonic()
        assert answered - signalled < 3, "the completion was not answered within the drain delay: no evidence"
        assert json.loads(response.read())["choices"][0]["text"]
        _wait_until_refused(server.http_port)
        assert time.monotonic() - signalled >= 3  # the listener stayed open for the whole delay
        assert server.proc.wait(timeout=30) == 0


def test_clients_resend_what_a_draining_server_refused_to_the_server_that_replaces_it():
    """A stream keeps the AsyncClient's connection busy, so the draining server answers the call pipelined
    beside it with `overloaded` ("shutting down") instead of closing; the Client's idle connection is closed.
    Both requests go again on new connections, are refused while nothing listens, and are answered by the
    server started on the same port; the stream finishes on the draining server."""
    want = offline_greedy(["Tom had a red"], [8])[0].token_ids
    with contextlib.ExitStack() as servers:
        first = servers.enter_context(launch_server("--shutdown-grace", "30"))
        sync_client = servers.enter_context(Client("127.0.0.1", first.port, retries=RESTART_RETRIES))
        assert sync_client.health()["status"] == "ok"

        async def run():
            async with AsyncClient("127.0.0.1", first.port, retries=RESTART_RETRIES) as client:
                stream = client.generate_stream(
                    "Once upon a time", max_tokens=400, ignore_eos=True, temperature=0
                )
                chunks = stream.__aiter__()
                await chunks.__anext__()
                first.proc.send_signal(signal.SIGTERM)
                await asyncio.to_thread(_wait_until_refused, first.port)
                call = asyncio.ensure_future(client.generate("Tom had a red", max_tokens=8, temperature=0))
                sync_call = asyncio.ensure_future(
                    asyncio.to_thread(sync_client.generate, "Tom had a red", max_tokens=8, temperature=0)
                )
                await asyncio.sleep(0.2)
                assert not call.done() and not sync_call.done()  # waiting for a server, not failed
                await asyncio.to_thread(servers.enter_context, launch_server("--port", str(first.port)))
                results = await asyncio.gather(call, sync_call)
                async for _ in chunks:
                    pass
                return stream.result, results

        stream_result, results = asyncio.run(run())
        assert [r.token_ids for r in results] == [want, want]
        assert stream_result.completion_tokens == 400  # the stream finished where it began
        assert first.proc.wait(timeout=30) == 0


def test_calls_a_killed_server_never_answered_are_resent_and_started_streams_raise():
    """SIGKILL, no drain. The server is stopped (SIGSTOP) once a Client's and an AsyncClient's streams have
    delivered a chunk, so nothing ends by itself; a call from each client is sent (the kernel takes the bytes,
    no answer comes); then the server is killed. The streams raise (sending them again would repeat their
    text); the calls had received nothing and are answered by the server started on the same port."""
    prompt, greedy = "Once upon a time", dict(max_tokens=400, ignore_eos=True, temperature=0)
    want = offline_greedy([prompt], [8])[0].token_ids
    with contextlib.ExitStack() as servers:
        first = servers.enter_context(launch_server())
        streamer = servers.enter_context(Client("127.0.0.1", first.port, retries=RESTART_RETRIES))
        sync_stream = iter(streamer.generate_stream(prompt, **greedy))
        next(sync_stream)

        def sync_call():
            with Client("127.0.0.1", first.port, retries=RESTART_RETRIES) as client:
                return client.generate(prompt, max_tokens=8, temperature=0)

        async def run():
            async with AsyncClient("127.0.0.1", first.port, retries=RESTART_RETRIES) as client:
                stream = client.generate_stream(prompt, **greedy)
                chunks = stream.__aiter__()
                await chunks.__anext__()
                first.proc.send_signal(signal.SIGSTOP)
                calls = [
                    asyncio.ensure_future(client.generate(prompt, max_tokens=8, temperature=0)),
                    asyncio.ensure_future(asyncio.to_thread(sync_call)),
                ]
                await asyncio.sleep(0.5)
                first.proc.kill()
                first.proc.wait()
                with pytest.raises(ConnectionError):
                    async for _ in chunks:
                        pass
                with pytest.raises(ConnectionError):
                    list(sync_stream)
                await asyncio.to_thread(servers.enter_context, launch_server("--port", str(first.port)))
                return await asyncio.gather(*calls)

        results = asyncio.run(run())
        assert [r.token_ids for r in results] == [want, want]
        first.proc.returncode = 0  # killed on purpose; launch_server's exit-status check is about draining
