"""The PROXY protocol (HAProxy's doc/proxy-protocol.txt, versions 1 and 2), receiving side: a load balancer
in front of the server starts each connection with a header naming the client it forwards, and that client's
address is the one every per-address rule counts (`serve --proxy-protocol-from CIDR`).

Only connections from the trusted networks are read for a header, and each of them must start with one: a
header from anywhere else is no header but the bytes of the door's own protocol (which fails on it as on any
bad input), so a client cannot pick its own address. The header is read from the socket before anything else
(TLS included), byte-exact: what follows it belongs to the connection. A strict parser of our own: the one
library on PyPI (proxy-protocol) reads through a buffering stream, which would swallow a TLS handshake's
first bytes, and bounds no v1 line.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import struct

V1_PREFIX = b"PROXY "
V1_MAX_BYTES = 107  # the spec's bound on a v1 line, its CRLF included
V2_SIGNATURE = b"\r\n\r\n\x00\r\nQUIT\n"
V2_MAX_PAYLOAD = 2048  # addresses (at most 216 bytes) and TLVs; the spec allows 65535, no balancer needs it
_V2_FIXED = 16  # signature, version and command, family and transport, payload length
_V2_ADDRESSES = {0x11: 12, 0x21: 36}  # TCP over IPv4, IPv6: source and destination addresses, then ports
# The other families and transports the spec defines (UNSPEC, UDP, UNIX): valid, but name no TCP client.
_V2_NO_CLIENT = {0x00, 0x01, 0x02, 0x10, 0x12, 0x20, 0x22, 0x30, 0x31, 0x32}


class ProxyHeaderError(ValueError):
    """A connection from a trusted proxy did not start with a valid PROXY header."""


class TrustedProxies:
    """The networks (`--proxy-protocol-from`) whose connections start with a PROXY header."""

    def __init__(self, specs: list[str]):
        """specs: CIDRs or addresses, an entry possibly a comma-separated list; ValueError names a bad one."""
        self.networks = []
        for spec in (s.strip() for entry in specs for s in entry.split(",")):
            try:
                self.networks.append(ipaddress.ip_network(spec, strict=False))
            except ValueError:
                raise ValueError(
                    f"{spec!r} is not an IP address or network (CIDR, e.g. 10.0.0.0/8)"
                ) from None

    def __contains__(self, ip: str) -> bool:
        try:
            parsed = ipaddress.ip_address(ip)
        except ValueError:  # a Unix socket's peer: no address to trust
            return False
        parsed = getattr(parsed, "ipv4_mapped", None) or parsed  # a dual-stack socket's ::ffff:a.b.c.d
        return any(parsed in network for network in self.networks)

    def __bool__(self) -> bool:
        return bool(self.networks)


async def read_header(sock: socket.socket) -> tuple[str, int] | None:
    """Read one PROXY header from a non-blocking socket, not a byte past it: the client's (ip, port), or None
    when the header says to use the connection's own peer (v2 LOCAL or no TCP address, v1 UNKNOWN).
    ProxyHeaderError if it is not a valid header; the caller bounds the time."""
    loop = asyncio.get_running_loop()
    start = await _receive(loop, sock, len(V1_PREFIX), b"")  # fewer bytes than either version's shortest
    if start == V2_SIGNATURE[: len(start)]:
        fixed = await _receive(loop, sock, _V2_FIXED - len(start), start)
        if not fixed.startswith(V2_SIGNATURE):
            raise ProxyHeaderError(f"the connection did not start with a PROXY header ({_shown(fixed)})")
        length = struct.unpack_from("!H", fixed, 14)[0]
        if length > V2_MAX_PAYLOAD:
            raise ProxyHeaderError(f"a v2 PROXY header of {length} bytes, more than {V2_MAX_PAYLOAD}")
        return parse_v2(await _receive(loop, sock, length, fixed))
    if start != V1_PREFIX:
        raise ProxyHeaderError(f"the connection did not start with a PROXY header ({_shown(start)})")
    line = start
    # byte by byte: a v1 line has no length, and a byte past its CRLF would be the connection's own
    while not line.endswith(b"\r\n"):
        if len(line) >= V1_MAX_BYTES:
            raise ProxyHeaderError(f"a v1 PROXY header without CRLF in its first {V1_MAX_BYTES} bytes")
        line = await _receive(loop, sock, 1, line)
    return parse_v1(line)


def parse_v1(line: bytes) -> tuple[str, int] | None:
    """A whole v1 line, its CRLF included."""
    if not line.startswith(V1_PREFIX) or not line.endswith(b"\r\n") or len(line) > V1_MAX_BYTES:
        raise ProxyHeaderError(f"not a v1 PROXY header line ({_shown(line)})")
    fields = line[len(V1_PREFIX) : -2].split(b" ")
    if fields[0] == b"UNKNOWN":  # the spec: whatever follows UNKNOWN is ignored
        return None
    if fields[0] not in (b"TCP4", b"TCP6") or len(fields) != 5:
        raise ProxyHeaderError(f"a v1 PROXY header must be TCP4, TCP6 or UNKNOWN ({_shown(line)})")
    version = 4 if fields[0] == b"TCP4" else 6
    source, _ = (_v1_address(f, version, line) for f in fields[1:3])
    port, _ = (_v1_port(f, line) for f in fields[3:5])
    return source, port


def parse_v2(header: bytes) -> tuple[str, int] | None:
    """A whole v2 header: its 16 fixed bytes and its payload."""
    if len(header) < _V2_FIXED or not header.startswith(V2_SIGNATURE):
        raise ProxyHeaderError("not a v2 PROXY header")
    version_command, family, length = struct.unpack_from("!BBH", header, len(V2_SIGNATURE))
    if length != len(header) - _V2_FIXED:
        raise ProxyHeaderError(f"a v2 PROXY header says {length} bytes follow, {len(header) - _V2_FIXED} do")
    if version_command >> 4 != 2 or version_command & 0xF > 1:
        raise ProxyHeaderError(
            f"a v2 PROXY header of version {version_command >> 4}, command {version_command & 0xF}"
        )
    if version_command & 0xF == 0:  # LOCAL: the balancer's own connection (a check); the rest is ignored
        return None
    if family not in _V2_ADDRESSES and family not in _V2_NO_CLIENT:
        raise ProxyHeaderError(f"a v2 PROXY header of unknown family/transport 0x{family:02x}")
    if family in _V2_NO_CLIENT:
        return None
    size = _V2_ADDRESSES[family]
    if length < size:
        raise ProxyHeaderError(f"a v2 PROXY header of {length} bytes for a {size}-byte address block")
    addresses = header[_V2_FIXED : _V2_FIXED + size]
    source = addresses[: (size - 4) // 2]
    (port,) = struct.unpack_from("!H", addresses, size - 4)
    return str(ipaddress.ip_address(source)), port


async def _receive(loop, sock: socket.socket, n: int, got: bytes) -> bytes:
    """`got` and the next `n` bytes of the socket."""
    wanted = len(got) + n
    while len(got) < wanted:
        chunk = await loop.sock_recv(sock, wanted - len(got))
        if not chunk:
            raise ProxyHeaderError(f"the connection closed after {len(got)} bytes of its PROXY header")
        got += chunk
    return got


def _v1_address(field: bytes, version: int, line: bytes) -> str:
    try:
        text = field.decode("ascii")
        address = ipaddress.IPv4Address(text) if version == 4 else ipaddress.IPv6Address(text)
    except (UnicodeDecodeError, ValueError):
        address = None
    if address is None or "%" in text:  # a scope id names no client
        raise ProxyHeaderError(f"a v1 PROXY header with a bad IPv{version} address ({_shown(line)})")
    return str(address)


def _v1_port(field: bytes, line: bytes) -> int:
    # decimal, 0-65535, no sign, no leading zero
    if not field.isdigit() or (len(field) > 1 and field[:1] == b"0") or int(field) > 65535:
        raise ProxyHeaderError(f"a v1 PROXY header with a bad port ({_shown(line)})")
    return int(field)


def _shown(data: bytes) -> str:
    """Bytes for a log line: the first few, escaped."""
    return repr(data[:48])[1:] + ("..." if len(data) > 48 else "")
