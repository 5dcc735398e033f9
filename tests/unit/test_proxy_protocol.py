"""The PROXY protocol parser (server/proxy_protocol.py) against headers written out by hand from HAProxy's
doc/proxy-protocol.txt, and its reader on a real socket pair: the header is read byte-exact (what follows it
stays in the socket for TLS or the door), and every malformed header is a ProxyHeaderError."""

import asyncio
import socket
import struct

import pytest

from minisarathi.server.proxy_protocol import (
    V2_SIGNATURE,
    ProxyHeaderError,
    TrustedProxies,
    parse_v1,
    parse_v2,
    read_header,
)


def v2(command: int, family: int, payload: bytes, length: int | None = None) -> bytes:
    """version 2, the command (0 LOCAL, 1 PROXY), family/transport byte, payload (addresses, TLVs)."""
    return (
        V2_SIGNATURE
        + bytes([0x20 | command, family])
        + struct.pack("!H", len(payload) if length is None else length)
        + payload
    )


TCP4_PAYLOAD = bytes([203, 0, 113, 7]) + bytes([10, 0, 0, 1]) + struct.pack("!HH", 51234, 443)
TCP6_PAYLOAD = socket.inet_pton(socket.AF_INET6, "2001:db8::7") + bytes(16) + struct.pack("!HH", 1, 8000)


@pytest.mark.parametrize(
    "line, client",
    [
        (b"PROXY TCP4 203.0.113.7 10.0.0.1 51234 443\r\n", ("203.0.113.7", 51234)),
        (b"PROXY TCP6 2001:db8::7 ::1 0 65535\r\n", ("2001:db8::7", 0)),
        (b"PROXY TCP6 ::ffff:203.0.113.7 ::1 80 80\r\n", ("::ffff:cb00:7107", 80)),
        (b"PROXY UNKNOWN\r\n", None),
        (b"PROXY UNKNOWN ffff:f...f:ffff ffff:f...f:ffff 65535 65535\r\n", None),  # the rest is ignored
    ],
)
def test_v1_lines(line, client):
    assert parse_v1(line) == client


@pytest.mark.parametrize(
    "line",
    [
        b"PROXY TCP4 203.0.113.7 10.0.0.1 51234\r\n",  # a field missing
        b"PROXY TCP4 203.0.113.7  10.0.0.1 51234 443\r\n",  # two spaces
        b"PROXY TCP4 203.0.113.7 10.0.0.1 051234 443\r\n",  # a leading zero
        b"PROXY TCP4 203.0.113.7 10.0.0.1 65536 443\r\n",
        b"PROXY TCP4 203.0.113.7 10.0.0.1 -1 443\r\n",
        b"PROXY TCP4 203.0.113.007 10.0.0.1 1 443\r\n",
        b"PROXY TCP4 2001:db8::7 10.0.0.1 1 443\r\n",  # IPv6 in TCP4
        b"PROXY TCP6 203.0.113.7 ::1 1 443\r\n",
        b"PROXY TCP6 fe80::1%eth0 ::1 1 443\r\n",  # a scope id
        b"PROXY UDP4 203.0.113.7 10.0.0.1 1 443\r\n",
        b"PROXY tcp4 203.0.113.7 10.0.0.1 1 443\r\n",
        b"PROXY TCP4 203.0.113.7 10.0.0.1 1 443\n",  # LF alone
        b"PROXY TCP4 \xff.0.113.7 10.0.0.1 1 443\r\n",
        b"PROXY UNKNOWN" + b" " * 100 + b"\r\n",  # past 107 bytes
    ],
)
def test_bad_v1_lines(line):
    with pytest.raises(ProxyHeaderError):
        parse_v1(line)


@pytest.mark.parametrize(
    "header, client",
    [
        (v2(1, 0x11, TCP4_PAYLOAD), ("203.0.113.7", 51234)),
        (v2(1, 0x21, TCP6_PAYLOAD), ("2001:db8::7", 1)),
        (v2(1, 0x11, TCP4_PAYLOAD + b"\x04\x00\x03abc"), ("203.0.113.7", 51234)),  # a TLV after
        (v2(0, 0x00, b""), None),  # LOCAL: a check from the balancer itself
        (v2(0, 0x77, b"anything"), None),  # LOCAL: the family and the block are ignored
        (v2(1, 0x00, b""), None),  # UNSPEC
        (v2(1, 0x12, TCP4_PAYLOAD), None),  # UDP names no TCP client
        (v2(1, 0x31, bytes(216)), None),  # UNIX
    ],
)
def test_v2_headers(header, client):
    assert parse_v2(header) == client


@pytest.mark.parametrize(
    "header",
    [
        v2(1, 0x11, TCP4_PAYLOAD[:11]),  # shorter than the address block
        v2(1, 0x21, TCP4_PAYLOAD),
        v2(2, 0x11, TCP4_PAYLOAD),  # an unknown command
        v2(1, 0x13, TCP4_PAYLOAD),  # an unknown transport
        v2(1, 0x41, TCP4_PAYLOAD),  # an unknown family
        v2(1, 0x11, TCP4_PAYLOAD, length=13),  # its length is not what follows
        v2(1, 0x11, TCP4_PAYLOAD).replace(b"\x21\x11", b"\x11\x11"),  # version 1 in the binary form
    ],
)
def test_bad_v2_headers(header):
    with pytest.raises(ProxyHeaderError):
        parse_v2(header)


def read_from(sent: bytes, trickle_s: float | None = None, close: bool = True):
    """read_header on one end of a socket pair after `sent` (byte by byte with trickle_s between) went in
    at the other; (its result or the ProxyHeaderError, the bytes left in the socket)."""

    async def run():
        ours, theirs = socket.socketpair()
        ours.setblocking(False)
        with ours, theirs:

            async def send():
                for i in range(len(sent)) if trickle_s else [None]:
                    theirs.sendall(sent if i is None else sent[i : i + 1])
                    await asyncio.sleep(trickle_s or 0)
                if close:
                    theirs.shutdown(socket.SHUT_WR)

            sending = asyncio.create_task(send())
            try:
                result = await asyncio.wait_for(read_header(ours), 5)
            except ProxyHeaderError as e:
                result = e
            await sending
            ours.setblocking(True)
            ours.settimeout(1)
            rest = b""
            while close and (chunk := ours.recv(1 << 16)):
                rest += chunk
            return result, rest

    return asyncio.run(run())


FOLLOWS = b"\x16\x03\x01 a TLS ClientHello, or the door's first message"


@pytest.mark.parametrize(
    "header, client",
    [
        (b"PROXY TCP4 203.0.113.7 10.0.0.1 51234 443\r\n", ("203.0.113.7", 51234)),
        (b"PROXY UNKNOWN\r\n", None),
        (v2(1, 0x21, TCP6_PAYLOAD + b"\x01\x00\x02h2"), ("2001:db8::7", 1)),
        (v2(0, 0x00, b""), None),
    ],
)
def test_the_header_is_read_and_not_a_byte_more(header, client):
    assert read_from(header + FOLLOWS) == (client, FOLLOWS)
    assert read_from(header + FOLLOWS, trickle_s=0.001) == (client, FOLLOWS)  # a header in pieces


@pytest.mark.parametrize(
    "sent, why",
    [
        (b"PROXY TCP4 203.0.113.7 10.0.0.1 51234", "closed after 37 bytes"),  # truncated
        (V2_SIGNATURE + b"\x21\x11\x00", "closed after 15 bytes"),
        (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", "did not start with a PROXY header"),
        (b"PROXY " + b"x" * 200, "without CRLF in its first 107 bytes"),  # oversized v1
        (v2(1, 0x11, b"", length=65535), "more than 2048"),  # oversized v2: refused before its payload
        (b"\x94\x00\x00\xa6health\x90", "did not start with a PROXY header"),  # refused at its 6th byte
        (V2_SIGNATURE[:8] + b"\x00" * 8, "did not start with a PROXY header"),
    ],
)
def test_bad_headers_on_the_socket(sent, why):
    result, _ = read_from(sent)
    assert isinstance(result, ProxyHeaderError) and why in str(result), result


def test_an_oversized_v1_line_reads_no_more_than_107_bytes():
    result, rest = read_from(b"PROXY " + b"x" * 200)
    assert isinstance(result, ProxyHeaderError) and len(rest) == 206 - 107


def test_trusted_proxies():
    proxies = TrustedProxies(["10.0.0.0/8, 192.0.2.1", "2001:db8::/32"])
    assert "10.1.2.3" in proxies and "192.0.2.1" in proxies and "2001:db8::1" in proxies
    assert "::ffff:10.1.2.3" in proxies  # a dual-stack socket's peer
    assert "192.0.2.2" not in proxies and "11.0.0.1" not in proxies and "2001:db9::1" not in proxies
    assert "unix" not in proxies
    with pytest.raises(ValueError, match="'10.0.0.0/33' is not an IP address or network"):
        TrustedProxies(["10.0.0.0/33"])
    with pytest.raises(ValueError, match="'' is not"):
        TrustedProxies(["10.0.0.0/8,"])
