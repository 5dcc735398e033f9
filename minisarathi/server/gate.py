"""What every door's connections pass before they reach it: per-address backoff for failed auths, the accept
loop (each connection counted by the hub from accept on, a trusted balancer's PROXY header and a TLS
handshake included, under the auth deadline; an optional accept rate per address), and quiet logging of
what a flood repeats. "Address" is always the client's (client_address; behind a trusted balancer, the one
its PROXY header names: proxy_protocol.py).

The backoff: each failed auth from an address spaces that address's next credential checks further apart
(50 ms doubling to 5 s, forgotten 10 minutes after its last failure), on every door at once. A check waits
for its address's turn *before* the credential is read, so neither new connections nor parallel requests
buy an attacker more guesses; a success resets nothing (an attacker holding a key of their own could
otherwise clear their backoff between guesses). Addresses without recent failures never wait.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import functools
import ipaddress
import logging
import os
import resource
import socket
import ssl
import stat
import struct
import time
from dataclasses import dataclass
from typing import Callable

from minisarathi.server.auth import Key
from minisarathi.server.proxy_protocol import ProxyHeaderError, TrustedProxies, read_header

log = logging.getLogger("minisarathi.server")

_OUT_OF_RESOURCES = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
_ACCEPT_RETRY_S = 0.1  # after accept() ran out of file descriptors: the others get a chance to close
_ABORT_LINGER = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends a reset


def client_address(ip: str) -> str:
    """What every per-address rule counts as one client: an IPv6 address by its /64 (one host is usually
    given a whole /64, so it could otherwise take a fresh address per connection), an IPv4 one as it is."""
    try:
        parsed = ipaddress.ip_address(ip)
    except ValueError:  # "unix", or no address at all
        return ip
    if parsed.version == 6 and parsed.ipv4_mapped is None:
        return str(ipaddress.ip_network(f"{parsed}/64", strict=False))
    return str(getattr(parsed, "ipv4_mapped", None) or parsed)


class RateLimitedLog:
    """One log line per interval for something a flood repeats: the first at once, then a count."""

    INTERVAL_S = 60.0

    def __init__(self, logger: logging.Logger, level: int = logging.WARNING):
        self._logger, self._level = logger, level
        self._last: float | None = None
        self._suppressed = 0

    def __call__(self, message: str, *args) -> None:
        now = time.monotonic()
        if self._last is not None and now - self._last < self.INTERVAL_S:
            self._suppressed += 1
            return
        more = (
            f" (and {self._suppressed} more like it in {now - self._last:.0f}s)" if self._suppressed else ""
        )
        self._logger.log(self._level, message + more, *args)
        self._last, self._suppressed = now, 0


@dataclass
class _Address:
    failures: int = 0
    last_failure: float = 0.0
    next_turn: float = 0.0  # monotonic time of the next credential check allowed


class AuthGate:
    """Failed auths per client address, shared by every door; see the module's docstring."""

    BASE_DELAY_S = 0.05
    MAX_DELAY_S = 5.0
    MAX_EXPONENT = 7  # 0.05 * 2**7 > 5 s: the exponent stops there (2**1024 is an OverflowError)
    FORGET_AFTER_S = 600.0
    MAX_ADDRESSES = 10_000  # the least recently failed are forgotten first: a flood of addresses is bounded
    MAX_WAIT_S = 30.0  # a check that would wait longer is refused at once (its address queued too many)
    LOG_INTERVAL_S = 60.0

    def __init__(self):
        self._addresses: collections.OrderedDict[str, _Address] = collections.OrderedDict()
        self.failures_total = 0
        self._interval_failures = 0
        self._interval_addresses: set[str] = set()
        self._interval_start = time.monotonic()

    def spacing_s(self, failures: int) -> float:
        """Seconds between two credential checks of an address with this many recent failures."""
        if failures == 0:
            return 0.0
        return min(self.MAX_DELAY_S, self.BASE_DELAY_S * 2 ** min(failures - 1, self.MAX_EXPONENT))

    def reserve(self, address: str) -> float | None:
        """Take the address's next turn: seconds to wait for it (0: now), or None if that would be more than
        MAX_WAIT_S (refuse the attempt unchecked)."""
        state = self._recent(address)
        if state is None:
            return 0.0
        now = time.monotonic()
        turn = max(now, state.next_turn)
        if turn - now > self.MAX_WAIT_S:
            return None
        state.next_turn = turn + self.spacing_s(state.failures)
        return turn - now

    def wait_s(self, address: str) -> float:
        """Seconds until the address's next turn, without taking it (0: none pending)."""
        state = self._recent(address)
        return 0.0 if state is None else max(0.0, state.next_turn - time.monotonic())

    async def turn(self, address: str) -> bool:
        """Wait for the address's turn to have a credential checked; False: refuse it unchecked."""
        wait = self.reserve(address)
        if wait is None:
            return False
        if wait > 0:
            await asyncio.sleep(wait)
        return True

    def failed(self, address: str) -> None:
        now = time.monotonic()
        state = self._recent(address) or _Address()
        state.failures = min(state.failures + 1, self.MAX_EXPONENT + 1)
        state.last_failure = now
        state.next_turn = max(state.next_turn, now + self.spacing_s(state.failures))
        self._addresses[address] = state
        self._addresses.move_to_end(address)
        if len(self._addresses) > self.MAX_ADDRESSES:
            self._addresses.popitem(last=False)
        self.failures_total += 1
        self._interval_failures += 1
        if len(self._interval_addresses) < self.MAX_ADDRESSES:
            self._interval_addresses.add(address)
        if now - self._interval_start >= self.LOG_INTERVAL_S:
            log.warning(
                "%d failed auth attempts from %d addresses in the last %.0fs",
                self._interval_failures,
                len(self._interval_addresses),
                now - self._interval_start,
            )
            self._interval_failures = 0
            self._interval_addresses.clear()
            self._interval_start = now

    def _recent(self, address: str) -> _Address | None:
        state = self._addresses.get(address)
        if state is not None and time.monotonic() - state.last_failure > self.FORGET_AFTER_S:
            del self._addresses[address]
            return None
        return state


class AcceptRate:
    """New connections per second per client address (`--accept-rate-per-address`; 0: no limit): a bucket
    of a second's worth (at least one), refilled continuously; a connection past it is refused at accept,
    before any TLS or protocol work. Off by default: behind a balancer without the PROXY protocol every
    client shares the balancer's address."""

    MAX_ADDRESSES = 10_000  # the least recently seen are forgotten first (a new bucket is a full one)

    def __init__(self, rate: float):
        self.rate, self.burst = rate, max(rate, 1.0)
        self._buckets: collections.OrderedDict[str, tuple[float, float]] = collections.OrderedDict()

    def admit(self, address: str) -> bool:
        if not self.rate or address == "unix":
            return True
        now = time.monotonic()
        tokens, at = self._buckets.pop(address, (self.burst, now))
        tokens = min(self.burst, tokens + (now - at) * self.rate)
        admitted = tokens >= 1.0
        self._buckets[address] = (tokens - admitted, now)  # address -> (tokens left, when)
        if len(self._buckets) > self.MAX_ADDRESSES:
            self._buckets.popitem(last=False)
        return admitted


class Arrival:
    """A connection accepted and not yet handed to its door (a TLS one during its handshake): the hub counts
    it as unauthenticated when there are keys (and evicting it ends the handshake), else as any connection."""

    key = None

    def __init__(self, ip: str, peer: str, authenticated: bool):
        self.ip, self.peer = ip, peer  # the client's IP ("unix") and "IP:PORT": a trusted proxy's header's
        self.address = client_address(ip)
        self.authenticated = authenticated
        self.opened = time.monotonic()
        self.closed = False
        self.task: asyncio.Task | None = None

    def close(self) -> None:
        self.closed = True
        if self.task is not None and not self.task.done():
            self.task.cancel()  # the half-made transport closes the socket


class Listener:
    """Accepts connections on a bound, listening socket (in place of asyncio's server, which counts nothing
    before a handshake completes and logs a traceback for each accept() past the file-descriptor limit)."""

    ACCEPTS_PER_TURN = 8

    def __init__(
        self,
        hub,
        sock: socket.socket,
        make_protocol: Callable[[Arrival], asyncio.Protocol],
        tls: ssl.SSLContext | None,
        proxies: TrustedProxies | None,
    ):
        self.hub, self.sock, self.tls, self.proxies = hub, sock, tls, proxies
        self._make_protocol = make_protocol
        self._retry: asyncio.TimerHandle | None = None  # accepting again after running out of descriptors
        self._handshakes: set[asyncio.Task] = set()
        self._accept_failed = RateLimitedLog(log)
        self._bad_header = RateLimitedLog(log)
        sock.setblocking(False)

    def start(self) -> None:
        self._retry = None
        asyncio.get_running_loop().add_reader(self.sock.fileno(), self._accept_some)

    def close(self) -> None:
        if self._retry is not None:
            self._retry.cancel()
        asyncio.get_running_loop().remove_reader(self.sock.fileno())
        self.sock.close()

    def _accept_some(self) -> None:
        """At most ACCEPTS_PER_TURN connections, then the loop's other work gets its turn: a flood's backlog
        drained in one go held everyone else's reads and writes (up to 400 ms with 1,100 reconnecting)."""
        for _ in range(self.ACCEPTS_PER_TURN):
            try:
                sock, peer = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                # out of descriptors: wait for some to close; else one connection failed (ECONNABORTED)
                self._accept_failed("cannot accept a connection: %s; retrying", e.strerror or e)
                if e.errno in _OUT_OF_RESOURCES:
                    loop = asyncio.get_running_loop()
                    loop.remove_reader(self.sock.fileno())
                    self._retry = loop.call_later(_ACCEPT_RETRY_S, self.start)
                    return
                continue
            sock.setblocking(False)
            self._arrived(sock, peer)

    def _arrived(self, sock: socket.socket, peer) -> None:
        tcp = isinstance(peer, tuple)
        ip, name = (peer[0], f"{peer[0]}:{peer[1]}") if tcp else ("unix", "unix")
        arrival = Arrival(ip, name, authenticated=self.hub.keys is None)
        address = arrival.address
        # An address holding its share of a full pool is refused before any TLS or protocol work; the others
        # count from now (a burst of accepts runs before their doors get them), except a plain connection
        # without keys: its door refuses it past --max-connections in its protocol (`overloaded`)
        counted = self.tls is not None or not arrival.authenticated
        proxied = tcp and self.proxies is not None and ip in self.proxies  # rated once its header is read
        refused = (
            (None if proxied else self.hub.pool.too_fast(address))
            or self.hub.pool.crowded(address)
            or (self.hub.pool.connect(arrival) if counted else None)
        )
        if refused is not None:
            self.hub.refused_log("connection from %s refused: %s", arrival.peer, refused)
            _reset(sock)
            return
        arrival.task = asyncio.get_running_loop().create_task(self._open(arrival, sock, proxied))
        self._handshakes.add(arrival.task)
        arrival.task.add_done_callback(self._handshakes.discard)

    async def _open(self, arrival: Arrival, sock: socket.socket, proxied: bool) -> None:
        loop = asyncio.get_running_loop()
        deadline = self.hub.limits.auth_timeout_s
        try:
            if proxied and not await self._take_proxy_header(arrival, sock, deadline):
                return
            protocol = functools.partial(self._make_protocol, arrival)
            if self.tls is None:
                await loop.connect_accepted_socket(protocol, sock)
            else:  # an address in backoff waits for its turn before its handshake's work
                if wait := self.hub.backoff_wait_s(arrival.address):
                    await asyncio.sleep(wait)
                async with asyncio.timeout(deadline):
                    # no TLS state before the client's ClientHello is whole: each stalled handshake cost an
                    # SSL object, 256 KiB of buffers and the door's protocol, torn down when it was evicted
                    await _first_record(sock)
                    await loop.connect_accepted_socket(
                        protocol, sock, ssl=self.tls, ssl_handshake_timeout=deadline
                    )
        except (OSError, asyncio.CancelledError, TimeoutError) as e:
            # a failed or stalled handshake (a plaintext client on the TLS port), or an eviction
            log.debug("connection from %s closed before it was served: %r", arrival.peer, e)
            sock.close()
            self.hub.pool.disconnect(arrival)  # served, it stays counted until its door's hand_over

    async def _take_proxy_header(self, arrival: Arrival, sock: socket.socket, deadline: float) -> bool:
        """A connection from a trusted proxy: its header's client becomes the arrival's (its pool share
        moves to that address, under the rules of a new connection from it). False: it was closed (no valid
        header within the deadline, or refused as that address's connection would be)."""
        try:
            async with asyncio.timeout(deadline):
                client = await read_header(sock)
        except TimeoutError:
            self._bad_header(
                "connection from proxy %s closed: no PROXY header within %.0fs", arrival.peer, deadline
            )
            return self._closed(arrival, sock)
        except ProxyHeaderError as e:
            self._bad_header("connection from proxy %s closed: %s", arrival.peer, e)
            return self._closed(arrival, sock)
        if client is not None:  # None: v2 LOCAL, v1 UNKNOWN (the proxy's own connection, e.g. a check)
            arrival.ip, arrival.peer = client[0], f"{client[0]}:{client[1]}"
            refused = self.hub.pool.readdress(arrival, client_address(client[0]))
            if refused is not None:
                self.hub.refused_log("connection from %s refused: %s", arrival.peer, refused)
                return self._closed(arrival, sock)
        return True

    def _closed(self, arrival: Arrival, sock: socket.socket) -> bool:
        _reset(sock)
        self.hub.pool.disconnect(arrival)
        return False


_TLS_HANDSHAKE = 0x16  # the content type of a TLS record carrying a ClientHello
_TLS_MAX_RECORD = (1 << 14) + 2048  # a record's most bytes after its 5-byte header (RFC 8446, 5.2)


async def _first_record(sock: socket.socket) -> None:
    """Until the client's first TLS record (its ClientHello) is whole in the socket's buffer, or its bytes
    cannot be one, or the stream ended: the kernel holds the partial record (SO_RCVLOWAT), not the loop."""
    want = 5  # the record's header, then the whole record
    while True:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, want)
        await _readable(sock)
        head = sock.recv(5, socket.MSG_PEEK)
        length = int.from_bytes(head[3:5], "big")
        if want > 5 or len(head) < 5 or head[0] != _TLS_HANDSHAKE or not 0 < length <= _TLS_MAX_RECORD:
            break  # the handshake takes it from here (and refuses what is not TLS)
        want = 5 + length
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)


async def _readable(sock: socket.socket) -> None:
    """Until the socket has bytes to read, or its end of stream."""
    loop = asyncio.get_running_loop()
    ready = loop.create_future()
    loop.add_reader(sock.fileno(), lambda: ready.done() or ready.set_result(None))
    try:
        await ready
    finally:
        loop.remove_reader(sock.fileno())


def _reset(sock: socket.socket) -> None:
    """Close with a reset, not a FIN: the descriptor is free at once and no TIME_WAIT is left on this side."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _ABORT_LINGER)
    sock.close()


def bind(host: str, port: int, backlog: int) -> list[socket.socket]:
    """Listening TCP sockets on every address `host` resolves to (as asyncio.start_server binds them)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    socks: list[socket.socket] = []
    try:
        for family, address in dict.fromkeys((info[0], info[4]) for info in infos):
            sock = socket.create_server((address[0], port, *address[2:]), family=family, backlog=backlog)
            socks.append(sock)
            port = sock.getsockname()[1]  # port 0: every address on the one port the first got
    except OSError:
        for sock in socks:
            sock.close()
        raise
    return socks


def bind_unix(path: str, backlog: int) -> socket.socket:
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISSOCK(os.stat(path).st_mode):  # a stale socket file, as asyncio's server removes it
            os.remove(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock


# File descriptors kept for everything but connections (the model's files, logs, the loop's own): past
# RLIMIT_NOFILE less these, a new connection closes the oldest unauthenticated one, or is refused.
_FD_RESERVE = 64


class ConnectionPool:
    """The open connections of the doors that keep them (the hub's `pool`): who gets in, and whom a flood
    of unauthenticated connections costs. A connection has address, authenticated, key, opened, closed,
    close()."""

    def __init__(self, limits, with_keys: bool):
        self.limits = limits  # ServerLimits
        self.with_keys = with_keys  # False: every connection is authenticated from the start
        self.connections: set = set()
        self.unauthenticated: dict = {}  # connections not yet authenticated, oldest first
        self.per_address = collections.Counter()  # client address -> its connections in unauthenticated
        self.evicted = 0  # unauthenticated connections closed to make room
        self.accept_rate = AcceptRate(limits.accept_rate_per_address)
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        self.max_open = max(soft - _FD_RESERVE, soft // 2) if soft != resource.RLIM_INFINITY else None

    def connect(self, conn) -> str | None:
        """Why a new connection is refused, or None once it is in. Authenticated (no keys): at most
        max_connections. With keys, an unauthenticated connection (its TLS handshake included) gets in unless
        its address already holds its share of a full pool (`crowded`); past their limits it closes the
        oldest unauthenticated one of its address, or of the address holding the most: a flood of connections
        without the key never locks a key holder (or another address) out, and costs the flooder its own.
        Past the file-descriptor limit, an unauthenticated connection makes room, if there is one."""
        if self.max_open is not None and len(self.connections) >= self.max_open:
            if not self.unauthenticated:
                return f"{len(self.connections)} connections open, near the file-descriptor limit"
            self.evict(self._oldest_of_largest_address())
        if conn.authenticated:
            if self._num_authenticated() >= self.limits.max_connections:
                return f"more than {self.limits.max_connections} connections"
        else:
            self._add_unauthenticated(conn)
        self.connections.add(conn)
        return None

    def readdress(self, conn, address: str) -> str | None:
        """A connection counted under a trusted proxy's address is its client's (the proxy's header named
        it): why it is refused as a new connection from that address would be (`too_fast`, `crowded`), or
        None once its share of the unauthenticated pool has moved there."""
        counted = conn in self.unauthenticated
        self._pool_remove(conn)
        conn.address = address
        refused = self.too_fast(address) or self.crowded(address)
        if refused is None and counted:
            self._add_unauthenticated(conn)
        return refused

    def hand_over(self, arrival: Arrival, conn) -> str | None:
        """The door's connection takes its arrival's place (and age) in the pool; an arrival evicted before
        its door got it is refused (else it would come back and evict another, a same-address key holder
        first). An arrival not counted (a plain one without keys) is counted now, by `connect`."""
        if arrival.closed:
            return "closed to make room for newer connections"
        if arrival not in self.connections:
            return self.connect(conn)
        self.connections.discard(arrival)
        self.connections.add(conn)
        if arrival in self.unauthenticated:  # same address: per_address is unchanged
            self.unauthenticated = {conn if c is arrival else c: None for c in self.unauthenticated}
        return None

    def too_fast(self, address: str) -> str | None:
        """Why a new connection from `address` is refused at accept for its rate (AcceptRate), or None."""
        if self.accept_rate.admit(address):
            return None
        return (
            f"more than {self.limits.accept_rate_per_address:g} new connections per second from its address"
        )

    def crowded(self, address: str) -> str | None:
        """Why a new unauthenticated connection from `address` is refused at accept, before any TLS or
        protocol work: the pool is full, other addresses are in it, and this one holds its share of it (the
        pool over the addresses in it), so letting it in would only close one of its own (a reconnecting
        flood would churn). An address alone in the pool is let in to close its own oldest: a key holder
        behind the same address (a NAT, a proxy) must still get in."""
        if not self.with_keys:
            return None
        full = len(self.unauthenticated) >= self.limits.max_unauthenticated_connections or (
            self.max_open is not None and len(self.connections) >= self.max_open
        )
        held = self.per_address[address]
        addresses = len(self.per_address) + (held == 0)
        if full and held and addresses > 1 and held * addresses >= len(self.unauthenticated):
            return f"its address holds {held} of {len(self.unauthenticated)} unauthenticated connections"
        return None

    def grant(self, conn, key: Key) -> bool:
        """auth succeeded: the connection leaves the unauthenticated pool, if there is room for it."""
        if not conn.authenticated:
            if self._num_authenticated() >= self.limits.max_connections:
                return False
            self._pool_remove(conn)
        conn.authenticated = True
        conn.key = key
        return True

    def revoke(self, conn):
        """Back to the unauthenticated pool; its auth deadline runs again from now."""
        if conn.authenticated and self.with_keys:
            conn.authenticated = False
            conn.opened = time.monotonic()
            self._pool_add(conn)

    def disconnect(self, conn):
        self.connections.discard(conn)
        self._pool_remove(conn)

    def _num_authenticated(self) -> int:
        return sum(1 for c in self.connections if c.authenticated and not c.closed)

    def _add_unauthenticated(self, conn) -> None:
        """Past the limits: the oldest unauthenticated connection of its address goes, or of the address
        holding the most."""
        if self.per_address[conn.address] >= self.limits.max_unauthenticated_per_address:
            self.evict(next(c for c in self.unauthenticated if c.address == conn.address))
        if len(self.unauthenticated) >= self.limits.max_unauthenticated_connections:
            self.evict(self._oldest_of_largest_address())
        self._pool_add(conn)

    def _pool_add(self, conn) -> None:
        self.unauthenticated[conn] = None
        self.per_address[conn.address] += 1

    def _pool_remove(self, conn) -> None:
        if self.unauthenticated.pop(conn, False) is None:
            self.per_address[conn.address] -= 1
            if not self.per_address[conn.address]:
                del self.per_address[conn.address]

    def _oldest_of_largest_address(self):
        address = self.per_address.most_common(1)[0][0]
        return next(c for c in self.unauthenticated if c.address == address)

    def evict(self, conn):
        self.evicted += 1
        self._pool_remove(conn)
        self.connections.discard(conn)  # its close() aborts its socket: the descriptor is free already
        conn.close()
