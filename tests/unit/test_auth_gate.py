"""gate.py: AuthGate on a fake clock (the per-address backoff every door shares), the accept loop."""

import asyncio
import errno
import logging
import socket
import ssl
from types import SimpleNamespace

import pytest
import trustme

from minisarathi.server import gate
from minisarathi.server.gate import AcceptRate, AuthGate, Listener, RateLimitedLog, client_address
from minisarathi.testing import FakeClock


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(gate.time, "monotonic", fake)
    return fake


def checks_in(auth_gate: AuthGate, address: str, clock: FakeClock, seconds: float) -> int:
    """Credential checks an address gets in `seconds` when it asks as fast as it can (every turn taken at
    once, as a client with many connections would)."""
    end, checks = clock.now + seconds, 0
    while (wait := auth_gate.reserve(address)) is not None and clock.now + wait < end:
        checks += 1
        clock.now += wait
    return checks


def test_failures_space_an_addresss_checks_doubling_and_capped(clock):
    auth_gate = AuthGate()
    assert [auth_gate.spacing_s(f) for f in range(4)] == [0.0, 0.05, 0.1, 0.2]
    assert auth_gate.spacing_s(10) == auth_gate.spacing_s(10_000) == AuthGate.MAX_DELAY_S
    for _ in range(5):
        auth_gate.failed("10.0.0.1")
    # after the 5th failure: at most 20 checks a second, however many connections ask at once
    assert checks_in(auth_gate, "10.0.0.1", clock, 10.0) <= 20 * 10
    assert auth_gate.reserve("10.0.0.2") == 0.0  # per address: another one never waits


def test_a_new_attempt_waits_for_its_turn_before_its_check(clock):
    """The old throttle slowed only the next read of the same connection: one new connection per guess
    cost nothing (1,389 guesses/s)."""
    auth_gate = AuthGate()
    auth_gate.failed("10.0.0.1")
    auth_gate.failed("10.0.0.1")
    first, second = auth_gate.reserve("10.0.0.1"), auth_gate.reserve("10.0.0.1")
    assert first == pytest.approx(0.1) and second == pytest.approx(0.2)  # two parallel attempts: in turn


def test_a_success_resets_nothing(clock):
    """A key holder's success (even from the attacker's own address) leaves every backoff as it was: no
    method exists to reset it; only time does."""
    auth_gate = AuthGate()
    for _ in range(6):
        auth_gate.failed("10.0.0.1")
    assert not hasattr(auth_gate, "succeeded")
    clock.now += AuthGate.FORGET_AFTER_S / 2
    assert auth_gate.reserve("10.0.0.1") == 0.0 and auth_gate.reserve("10.0.0.1") > 1.0
    clock.now += AuthGate.FORGET_AFTER_S + 10
    assert auth_gate.reserve("10.0.0.1") == auth_gate.reserve("10.0.0.1") == 0.0


def test_thousands_of_failures_do_not_overflow(clock):
    """0.05 * 2**count raised OverflowError after ~1,024 failures of one address."""
    auth_gate = AuthGate()
    for _ in range(2000):
        auth_gate.failed("10.0.0.1")
    assert auth_gate.spacing_s(2000) == AuthGate.MAX_DELAY_S
    assert auth_gate.failures_total == 2000


def test_a_queue_too_long_is_refused_unchecked(clock):
    auth_gate = AuthGate()
    for _ in range(10):
        auth_gate.failed("10.0.0.1")
    waits = [auth_gate.reserve("10.0.0.1") for _ in range(20)]
    assert None in waits and max(w for w in waits if w is not None) <= AuthGate.MAX_WAIT_S


def test_a_flood_of_addresses_keeps_the_table_bounded(clock, monkeypatch):
    monkeypatch.setattr(AuthGate, "MAX_ADDRESSES", 100)
    auth_gate = AuthGate()
    for i in range(1000):
        auth_gate.failed(f"10.0.{i // 256}.{i % 256}")
    assert len(auth_gate._addresses) == 100


def test_ipv6_clients_are_one_address_per_64_and_share_its_backoff(clock):
    """Per-address rules keyed by the full IPv6 address: a host holding a /64 had 2**64 fresh addresses."""
    same_64 = [client_address(ip) for ip in ("2001:db8:1:2::1", "2001:db8:1:2:ffff:0:0:7")]
    assert same_64 == ["2001:db8:1:2::/64"] * 2
    assert client_address("2001:db8:1:3::1") != same_64[0]  # the next /64 is another client
    assert client_address("::ffff:192.0.2.7") == client_address("192.0.2.7") == "192.0.2.7"
    assert client_address("unix") == "unix"
    auth_gate = AuthGate()
    for _ in range(5):
        auth_gate.failed(client_address("2001:db8:1:2::1"))
    assert auth_gate.wait_s(client_address("2001:db8:1:2::99")) > 0  # another address of the same /64 waits
    assert auth_gate.wait_s(client_address("2001:db8:1:3::1")) == 0


def test_turn_waits_on_the_loop():
    auth_gate = AuthGate()
    auth_gate.failed("10.0.0.1")

    async def two_turns():
        loop = asyncio.get_running_loop()
        start = loop.time()
        assert await auth_gate.turn("10.0.0.1") and await auth_gate.turn("10.0.0.1")
        return loop.time() - start

    assert asyncio.run(two_turns()) >= 0.05


def test_failures_are_logged_as_one_summary_per_interval(clock, caplog):
    auth_gate = AuthGate()
    for i in range(13):
        auth_gate.failed(f"10.0.0.{i % 3}")
    assert not caplog.records
    clock.now += AuthGate.LOG_INTERVAL_S
    auth_gate.failed("10.0.0.9")
    assert [r.getMessage() for r in caplog.records] == [
        "14 failed auth attempts from 4 addresses in the last 60s"
    ]


def test_a_rate_limited_log_writes_one_line_per_interval_with_a_count(clock, caplog):
    caplog.set_level(logging.INFO)
    quiet = RateLimitedLog(logging.getLogger("test.gate"))
    for _ in range(50):
        quiet("refused %s", "x")
    clock.now += RateLimitedLog.INTERVAL_S
    quiet("refused %s", "y")
    assert [r.getMessage() for r in caplog.records] == ["refused x", "refused y (and 49 more like it in 60s)"]


def fake_hub(pool=None, keys=None, auth_timeout_s: float = 5.0) -> SimpleNamespace:
    """What a Listener uses of the hub; the pool lets everyone in."""
    pool = pool or SimpleNamespace(connect=lambda conn: None, disconnect=lambda conn: None)
    pool.__dict__.setdefault("crowded", lambda address: None)
    pool.__dict__.setdefault("too_fast", lambda address: None)
    return SimpleNamespace(
        pool=pool,
        keys=keys,
        limits=SimpleNamespace(auth_timeout_s=auth_timeout_s),
        backoff_wait_s=lambda address: 0.0,
    )


class FailingSocket(socket.socket):
    """A listening socket whose next accept() calls raise `failures` (popped), as past the fd limit."""

    failures: list = []

    def accept(self):
        if self.failures:
            raise self.failures.pop()
        return super().accept()


def test_accept_past_the_file_descriptor_limit_retries_and_logs_one_line(caplog):
    """asyncio's server logged a traceback for each accept() that ran out of descriptors."""
    made = []

    async def serve() -> None:
        listening = socket.create_server(("127.0.0.1", 0))
        listening = FailingSocket(fileno=listening.detach())
        FailingSocket.failures = [OSError(errno.EMFILE, "Too many open files")] * 5
        listener = Listener(
            fake_hub(), listening, lambda arrival: made.append(arrival) or asyncio.Protocol(), None, None
        )
        listener.start()
        with socket.create_connection(listening.getsockname()):
            for _ in range(200):
                if made:
                    break
                await asyncio.sleep(0.01)
        listener.close()

    asyncio.run(serve())
    assert len(made) == 1 and made[0].address == "127.0.0.1"
    assert not FailingSocket.failures  # each retried, 0.1 s apart
    assert [r.getMessage() for r in caplog.records] == [
        "cannot accept a connection: Too many open files; retrying"
    ]
    assert not any(r.exc_info for r in caplog.records)


def test_a_backlog_of_connections_is_accepted_a_few_per_loop_turn():
    """The accept loop drained the whole backlog without yielding: with 1,100 reconnecting TLS stallers one
    loop turn took up to 400 ms, and every other client's reads and writes waited."""
    counted, per_turn = [], []

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        listening = socket.create_server(("127.0.0.1", 0), backlog=64)
        hub = fake_hub(SimpleNamespace(connect=counted.append, disconnect=lambda conn: None), keys=())
        listener = Listener(hub, listening, lambda arrival: asyncio.Protocol(), None, None)
        clients = [socket.create_connection(listening.getsockname()) for _ in range(40)]  # in the backlog

        def tick(seen: int) -> None:  # once per loop turn: the connections accepted during the last one
            per_turn.append(len(counted) - seen)
            if len(counted) < len(clients):
                loop.call_soon(tick, len(counted))

        listener.start()
        loop.call_soon(tick, 0)
        for _ in range(200):
            if len(counted) == len(clients):
                break
            await asyncio.sleep(0.01)
        listener.close()
        for sock in clients:
            sock.close()

    asyncio.run(serve())
    assert len(counted) == 40
    assert max(per_turn) <= Listener.ACCEPTS_PER_TURN < 40


def closed_by_peer(sock: socket.socket) -> bool:
    """A non-blocking socket's peer has closed it (an end of stream or a reset; no byte was sent to it)."""
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:  # closed with the client's bytes unread
        return True


def test_a_stalled_handshake_gets_no_tls_state_and_the_deadline_still_closes_it():
    """Each stalled TLS handshake (a client that connects and sends nothing, or part of a ClientHello) got an
    SSL object, 256 KiB of buffers and the door's protocol at accept, torn down again when it was evicted:
    most of the loop's time per connection churned by a slowloris. TLS now starts with a whole ClientHello
    record, within the same deadline."""
    ca = trustme.CA()
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_context)
    client_context = ssl.create_default_context()
    ca.configure_trust(client_context)
    made = []
    # nothing, the first byte, a record header, all but one byte of a 512-byte ClientHello record
    stalls = [b"", b"\x16", b"\x16\x03\x01\x02\x00", b"\x16\x03\x01\x02\x00" + b"\x01" * 511]

    async def serve() -> None:
        listening = socket.create_server(("127.0.0.1", 0))
        hub = fake_hub(auth_timeout_s=0.5)
        listener = Listener(
            hub, listening, lambda arrival: made.append(arrival) or asyncio.Protocol(), server_context, None
        )
        listener.start()
        address = listening.getsockname()
        stalled = [socket.create_connection(address) for _ in range(8)]
        for i, sock in enumerate(stalled):
            sock.sendall(stalls[i % len(stalls)])
            sock.setblocking(False)
        not_tls = socket.create_connection(address)
        not_tls.sendall(b"GET / HTTP/1.1\r\n\r\n")  # a plaintext client: TLS refuses it at once
        not_tls.setblocking(False)
        reader, writer = await asyncio.open_connection(*address, ssl=client_context)  # a whole handshake
        await asyncio.sleep(0.1)
        assert len(made) == 2  # the whole handshake and the plaintext one: no TLS for the stalled ones
        assert closed_by_peer(not_tls)  # long before the deadline
        assert not any(closed_by_peer(sock) for sock in stalled)
        writer.close()
        for _ in range(300):  # the deadline closes the stalled ones
            if all(map(closed_by_peer, stalled)):
                break
            await asyncio.sleep(0.01)
        else:
            raise AssertionError("stalled handshakes outlived the deadline")
        listener.close()
        for sock in [*stalled, not_tls]:
            sock.close()

    asyncio.run(serve())


def test_the_accept_rate_is_a_bucket_per_address(clock):
    rate = AcceptRate(5.0)
    assert [rate.admit("127.0.0.2") for _ in range(7)] == [True] * 5 + [False] * 2  # a second's burst
    assert rate.admit("127.0.0.3")  # another address has its own
    clock.now += 0.2  # one more
    assert [rate.admit("127.0.0.2") for _ in range(2)] == [True, False]
    clock.now += 10  # refilled to the burst, no more
    assert sum(rate.admit("127.0.0.2") for _ in range(20)) == 5
    assert all(rate.admit("unix") for _ in range(20))  # the Unix socket is local


def test_the_accept_rate_is_off_at_zero_and_bounded_in_addresses(clock):
    assert all(AcceptRate(0.0).admit("127.0.0.2") for _ in range(1000))
    slow = AcceptRate(0.5)  # below one a second: a burst of one
    assert [slow.admit("a"), slow.admit("a")] == [True, False]
    clock.now += 2
    assert slow.admit("a")
    many = AcceptRate(1.0)
    for i in range(AcceptRate.MAX_ADDRESSES + 10):
        many.admit(f"10.0.{i // 256}.{i % 256}")
    assert len(many._buckets) == AcceptRate.MAX_ADDRESSES
