"""Clients that read only part of MessagePack-RPC, as docs/protocol.md tells them to connect: an error form
Neovim's rpcrequest shows (it reads a string or [0 or 1, message], anything else is "unknown error"), and
no notifications for clients that break on them (msgpack-rpc-python) or drop them (msgpack-rpc-lite)."""

import socket

import msgpack
import pytest
from test_server import launch_server

KEY = "foreign-client-key"


@pytest.fixture(scope="module")
def server():
    with launch_server(env={"MINISARATHI_API_KEY": KEY}) as s:
        yield s


class RawClient:
    """One request at a time; every message before the response is kept in `before`."""

    def __init__(self, port: int):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        self.unpacker = msgpack.Unpacker(raw=False)
        self.msgid = 0
        self.before: list = []

    def call(self, method: str, *params):
        self.msgid += 1
        self.sock.sendall(msgpack.packb([0, self.msgid, method, list(params)]))
        self.before = []
        while True:
            for message in self.unpacker:
                if message[0] == 1 and message[1] == self.msgid:
                    return message[2], message[3]
                self.before.append(message)
            data = self.sock.recv(65536)
            assert data, "the server closed the connection"
            self.unpacker.feed(data)

    def close(self):
        self.sock.close()


def neovim_error(error) -> str:
    """What Neovim's rpc_send_call makes of a response's error (src/nvim/msgpack_rpc/channel.c)."""
    if isinstance(error, str):
        return error
    if isinstance(error, list) and len(error) == 2 and error[0] in (0, 1) and isinstance(error[1], str):
        return error[1]
    return "unknown error"


def test_neovim_reads_errors_in_the_string_form_auth_included(server):
    client = RawClient(server.port)
    try:
        error, _ = client.call("generate", {"prompt": "Zoo"})
        assert neovim_error(error) == "unknown error"  # the default map
        error, result = client.call("options", {"errors": "string"})
        assert error is None and result == {"errors": "string", "notifications": True}
        error, _ = client.call("auth", "wrong")
        assert neovim_error(error) == "unauthorized: wrong API key"
        assert client.call("auth", KEY) == (None, True)
        error, _ = client.call("generate", {"prompt": "Zoo", "max_tokens": 10**6})
        assert neovim_error(error).startswith("invalid_params: max_tokens must be <= ")
        error, _ = client.call("options", {"errors": "json"})
        assert neovim_error(error) == "invalid_params: errors must be one of map, string, array, got 'json'"
        error, _ = client.call("options", {"colour": True})
        assert neovim_error(error) == "invalid_params: unknown option 'colour'"
        error, result = client.call("options", {"errors": "array"})
        assert result == {"errors": "array", "notifications": True}
        error, _ = client.call("no_such_method")
        assert error == [2, "unknown method 'no_such_method'"]  # [code, message]: the code kept
    finally:
        client.close()


def test_without_notifications_a_streamed_call_answers_once(server):
    client = RawClient(server.port)
    try:
        assert client.call("auth", KEY) == (None, True)
        params = {"prompt": "Once upon", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        error, streamed = client.call("generate", {**params, "stream": True})
        assert error is None and len(client.before) == 12  # one chunk per token
        assert client.call("options", {"notifications": False})[1]["notifications"] is False
        error, result = client.call("generate", {**params, "stream": True})
        assert error is None and client.before == []  # nothing a notification-shy client trips on
        assert result["token_ids"] == streamed["token_ids"] and result["text"] == streamed["text"]
    finally:
        client.close()


def test_without_notifications_a_bad_message_only_closes(server):
    client = RawClient(server.port)
    try:
        client.call("options", {"notifications": False})
        client.sock.sendall(b"\xc1")  # never valid msgpack: there is no msgid to answer
        data = b""
        while chunk := client.sock.recv(65536):
            data += chunk
        assert data == b""  # no [2, "error", ...] notification before the end of the stream
    finally:
        client.close()
