"""`serve --proxy-protocol-from`: a connection from a trusted address starts with a PROXY header (v1 or v2,
read before TLS), and the client it names is the address of every per-address rule (the auth backoff, the
request log, IPv6 /64 grouping), on both doors. Here 127.0.0.1 plays the balancer; 127.0.0.2 is a client
that is not trusted, whose header is no header but bad input."""

import importlib.util
import json
import socket
import ssl
import struct
import time

import msgpack
import pytest
import trustme
from test_server import launch_server
from test_server_keys import http_port

from minisarathi.server.auth import add_key
from minisarathi.server.protocol import INVALID_MESSAGE, UNAUTHORIZED
from minisarathi.server.proxy_protocol import V2_SIGNATURE

pytestmark = pytest.mark.skipif(not importlib.util.find_spec("aiohttp"), reason="the http extra is needed")
AUTH_TIMEOUT_S = 1.5


def v1(ip: str, port: int = 40000) -> bytes:
    family = "TCP6" if ":" in ip else "TCP4"
    return f"PROXY {family} {ip} {'::1' if ':' in ip else '127.0.0.1'} {port} 7000\r\n".encode()


def v2(ip: str | None, port: int = 40000) -> bytes:
    """A PROXY command naming ip:port, or LOCAL for None."""
    if ip is None:
        return V2_SIGNATURE + b"\x20\x00\x00\x00"
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    source = socket.inet_pton(family, ip)
    payload = source + bytes(len(source)) + struct.pack("!HH", port, 7000)
    return (
        V2_SIGNATURE + bytes([0x21, 0x21 if ":" in ip else 0x11]) + struct.pack("!H", len(payload)) + payload
    )


def start_server(tmp_path, *extra: str):
    path = tmp_path / "keys.toml"
    secret = add_key(path, "alice")
    launched = launch_server(
        "--keys-file",
        str(path),
        "--http-port",
        "0",
        "--proxy-protocol-from",
        "127.0.0.1/32,192.0.2.0/24",
        "--auth-timeout",
        str(AUTH_TIMEOUT_S),
        "--log-level",
        "INFO",
        "--log-format",
        "json",
        *extra,
    )
    return launched, secret


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    launched, secret = start_server(tmp_path_factory.mktemp("keys"))
    with launched as s:
        s.secret, s.http_port = secret, http_port(s)
        yield s
        assert "Traceback" not in open(s.log_path).read()


def connect(port: int, header: bytes = b"", source: str = "127.0.0.1", tls: ssl.SSLContext | None = None):
    sock = socket.socket()
    sock.settimeout(30)
    sock.bind((source, 0))
    sock.connect(("127.0.0.1", port))
    sock.sendall(header)
    return sock if tls is None else tls.wrap_socket(sock, server_hostname="127.0.0.1")


def call(sock, method: str, *params, msgid: int = 0):
    """One msgpack-RPC call; its response [1, msgid, error, result]."""
    sock.sendall(msgpack.packb([0, msgid, method, list(params)]))
    unpacker = msgpack.Unpacker()
    while True:
        data = sock.recv(1 << 16)
        if not data:
            raise ConnectionError("closed")
        unpacker.feed(data)
        for message in unpacker:
            return message


def generate_msgpack(server, header: bytes, prompt: str, tls=None) -> dict:
    with connect(server.port, header, tls=tls) as sock:
        assert call(sock, "auth", server.secret)[2] is None
        response = call(sock, "generate", {"prompt": prompt, "max_tokens": 2}, msgid=1)
    assert response[2] is None, response
    return logged(server, prompt)


def generate_http(server, header: bytes, prompt: str, tls=None) -> dict:
    body = json.dumps({"model": "stories260K", "prompt": prompt, "max_tokens": 2}).encode()
    with connect(server.http_port, header, tls=tls) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
            + f"Content-Type: application/json\r\nAuthorization: Bearer {server.secret}\r\n".encode()
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        response = receive_all(sock)
    assert response.startswith(b"HTTP/1.1 200"), response[:300]
    return logged(server, prompt)


def receive_all(sock) -> bytes:
    data = b""
    try:
        while chunk := sock.recv(1 << 16):
            data += chunk
    except ConnectionError:
        pass
    return data


def logged(server, prompt: str) -> dict:
    """The request log's line of the request with this prompt."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for line in open(server.log_path):
            if line.startswith("{") and json.loads(line).get("prompt") == prompt:
                return json.loads(line)
        time.sleep(0.05)
    raise AssertionError(f"no request log line for {prompt!r}")


def guess_s(server, header: bytes) -> float:
    """Seconds a wrong key takes to be answered on a new msgpack connection with this header."""
    start = time.monotonic()
    with connect(server.port, header) as sock:
        assert call(sock, "auth", "wrong")[2]["code"] == UNAUTHORIZED
    return time.monotonic() - start


@pytest.mark.parametrize("version", [v1, v2])
def test_the_headers_client_is_the_address_on_both_doors(server, version):
    for door, generate in (("msgpack", generate_msgpack), ("http", generate_http)):
        for ip in ("203.0.113.7", "2001:db8::7"):
            line = generate(server, version(ip, 40001), f"Zoo {version.__name__} {door} {ip}")
            assert line["client"] in (f"{ip}:40001", ip), line  # msgpack logs the port too


@pytest.mark.parametrize("header", [v2(None), b"PROXY UNKNOWN\r\n"])
def test_local_and_unknown_use_the_proxys_own_address(server, header):
    name = "LOCAL" if header.startswith(V2_SIGNATURE) else "UNKNOWN"
    assert generate_msgpack(server, header, f"Zoo msgpack {name}")["client"].startswith("127.0.0.1:")
    assert generate_http(server, header, f"Zoo http {name}")["client"] == "127.0.0.1"


def test_the_backoff_counts_the_client_behind_the_proxy(server):
    """One hostile client behind the balancer no longer throttles the other key holders behind it; its own
    /64 (IPv6) shares its backoff, another /64 does not."""
    for hostile, neighbour, other in (
        ("198.51.100.66", "198.51.100.66", "198.51.100.67"),
        ("2001:db8:0:1::1", "2001:db8:0:1::2", "2001:db8:0:2::1"),
    ):
        for _ in range(5):
            guess_s(server, v2(hostile))
        assert guess_s(server, v1(neighbour)) > 0.5  # 0.05 s doubling: the 6th waits 0.8 s
        assert guess_s(server, v1(other)) < 0.3
        start = time.monotonic()
        generate_msgpack(server, v1(other), f"Zoo backoff {other}")
        generate_http(server, v2(other), f"Zoo backoff http {other}")
        assert time.monotonic() - start < 3


@pytest.mark.parametrize(
    "sent",
    [
        msgpack.packb([0, 0, "health", []]),  # no header at all
        b"PROXY TCP4 203.0.113.7 127.0.0.1 40000\r\n",  # a field missing
        b"PROXY " + b"x" * 200,  # oversized
        V2_SIGNATURE + b"\x21\x11\x00\x04abcd",  # too short for its addresses
        b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n",
    ],
)
def test_a_trusted_connection_without_a_valid_header_is_closed(server, sent):
    for port in (server.port, server.http_port):
        with connect(port, sent) as sock:
            assert receive_all(sock) == b""


def test_truncated_and_slow_headers_end_at_the_auth_deadline(server):
    start = time.monotonic()
    socks = [
        connect(port, header) for port in (server.port, server.http_port) for header in (b"", b"PROXY TCP4 ")
    ]
    for sock in socks:
        assert receive_all(sock) == b""
        sock.close()
    assert AUTH_TIMEOUT_S * 0.9 < time.monotonic() - start < 4 * AUTH_TIMEOUT_S
    log = open(server.log_path).read()
    assert "connection from proxy 127.0.0.1:" in log and "Traceback" not in log


def test_a_header_from_an_untrusted_address_is_not_trusted(server):
    with connect(server.port, v1("203.0.113.9"), source="127.0.0.2") as sock:
        response = msgpack.unpackb(receive_all(sock))  # the header's bytes, read as msgpack: a protocol error
    assert response[:2] == [2, "error"] and response[2][0]["code"] == INVALID_MESSAGE, response
    with connect(server.http_port, v1("203.0.113.9") + b"GET /health HTTP/1.1\r\n\r\n", "127.0.0.2") as sock:
        status_line = receive_all(sock).split(b"\r\n", 1)[0]
    assert b" 400 " in status_line, status_line  # aiohttp reads PROXY as a bad method


def test_the_header_comes_before_tls(tmp_path):
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    cert.cert_chain_pems[0].write_to_path(str(tmp_path / "server.pem"))
    cert.private_key_pem.write_to_path(str(tmp_path / "server.key"))
    context = ssl.create_default_context()
    ca.configure_trust(context)
    launched, secret = start_server(
        tmp_path, "--tls-cert", str(tmp_path / "server.pem"), "--tls-key", str(tmp_path / "server.key")
    )
    with launched as server:
        server.secret, server.http_port = secret, http_port(server, "https")
        assert (
            generate_msgpack(server, v2("203.0.113.8"), "Zoo tls", tls=context)["client"]
            == "203.0.113.8:40000"
        )
        assert generate_http(server, v1("203.0.113.8"), "Zoo https", tls=context)["client"] == "203.0.113.8"
        with pytest.raises((ssl.SSLError, ConnectionError)):  # a TLS client behind no header
            connect(server.port, tls=context)
        assert "Traceback" not in open(server.log_path).read()


def answered(port: int, header: bytes = b"", source: str = "127.0.0.1") -> bool:
    """A new connection's `options` call is answered (not reset at accept)."""
    try:
        with connect(port, header, source) as sock:
            return call(sock, "options", {})[0] == 1
    except ConnectionError:
        return False


def test_the_accept_rate_counts_each_address_and_the_client_behind_the_proxy(tmp_path):
    """--accept-rate-per-address 5: a burst of 5 new connections per address, then 5 a second; the
    balancer's own address is not rated, the clients its headers name are."""
    launched, _ = start_server(tmp_path, "--accept-rate-per-address", "5")
    with launched as server:
        assert sum(answered(server.port, source="127.0.0.2") for _ in range(12)) == 5
        assert answered(server.port, source="127.0.0.3")  # another address
        assert sum(answered(server.port, v1("203.0.113.5")) for _ in range(12)) == 5
        assert sum(answered(server.port, v2("203.0.113.6")) for _ in range(6)) == 5
        assert answered(server.port, v2(None))  # the balancer's own, past 25 connections in all
        time.sleep(0.5)  # two more a second later (2.5 at 5 a second)
        assert sum(answered(server.port, source="127.0.0.2") for _ in range(4)) == 2
        log = open(server.log_path).read()
        assert "new connections per second from its address" in log and "Traceback" not in log
