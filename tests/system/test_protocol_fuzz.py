"""Property-based fuzzing of the msgpack door (hypothesis, bounded to seconds): whatever a client sends, it
gets the protocol's answer (a result, or an error naming a field in the protocol's words) and everyone
else is served; nothing crashes, nothing leaks."""

import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_server import RawConnection, launch_server, wait_until_idle

from minisarathi.client import Client
from minisarathi.server.protocol import (
    ERROR_NAMES,
    GENERATE_FIELDS,
    INVALID_MESSAGE,
    INVALID_PARAMS,
    RPCError,
    ServerLimits,
    parse_generate,
)

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
# Python's own words for types and failures, which a client must never see
PYTHON_WORDS = re.compile(
    r"Error\b|Exception|Traceback|unhashable|NoneType|object has no|object is not|"
    r"got (dict|list|tuple|bytes|str|int)\b|'(list|dict|str|bytes|int)'"
)

ints = st.integers(-(2**63), 2**64 - 1)  # what msgpack can carry
scalars = (
    st.none()
    | st.booleans()
    | ints
    | st.floats(allow_nan=True)
    | st.text(max_size=20)
    | st.binary(max_size=20)
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8) | ints, inner, max_size=5)
    ),
    max_leaves=20,
)
field_maps = st.dictionaries(
    st.sampled_from(sorted(GENERATE_FIELDS)) | st.text(max_size=6), values, max_size=8
)


@FUZZ
@given(params=st.lists(values | field_maps, max_size=3) | st.builds(lambda m: [m], field_maps))
def test_generate_params_parse_or_fail_with_a_named_field(params):
    limits = ServerLimits(max_message_bytes=4096)
    try:
        request = parse_generate(params, limits)
    except RPCError as e:
        assert e.code == INVALID_PARAMS
        assert not PYTHON_WORDS.search(e.message), e.message
    else:
        assert (request.prompt is None) != (request.prompt_token_ids is None)
        assert request.params.max_tokens <= limits.max_tokens


@pytest.fixture(scope="module")
def server():
    with launch_server("--num-kv-blocks", "256", "--max-message-bytes", "65536") as s:
        yield s


METHODS = ["generate", "tokenize", "detokenize", "abort", "model_info", "health", "stats", "auth"]
requests = st.tuples(
    st.just(0),
    st.integers(0, 2**32 - 1),
    st.sampled_from(METHODS) | st.text(max_size=8),
    st.lists(values | field_maps, max_size=3) | values,
)


def answer_to(conn: RawConnection, msgid):
    """The response to msgid (stream chunks skipped), or the error notification before a close."""
    while True:
        message = conn.receive()
        if message is None or message[0] == 1 and message[1] == msgid:
            return message
        if message[0] == 2 and message[1] == "error":
            return message


@FUZZ
@given(request=requests)
def test_any_request_gets_a_protocol_answer_and_the_server_stays_up(server, request):
    request = list(request)
    if (
        request[2] == "generate"
        and isinstance(request[3], list)
        and request[3]
        and isinstance(request[3][0], dict)
    ):
        request[3][0].setdefault("max_tokens", 4)  # keep generated work small; any value may still come
    conn = RawConnection(server)
    conn.send(request)
    answer = answer_to(conn, request[1])
    conn.close()
    assert answer is not None, "closed without an answer"
    if answer[0] == 1:
        error = answer[2]
        if error is not None:
            assert error["code"] in ERROR_NAMES and not PYTHON_WORDS.search(error["message"]), error
    else:
        assert answer[2][0]["code"] == INVALID_MESSAGE


@FUZZ
@given(data=st.binary(min_size=1, max_size=64))
def test_any_bytes_get_an_answer_or_wait_and_the_server_stays_up(server, data):
    conn = RawConnection(server)
    conn.sock.settimeout(0.1)
    conn.sock.sendall(data)
    try:
        message = conn.receive()
    except TimeoutError:  # an unfinished message: the server waits for the rest
        message = "waiting"
    conn.close()
    if message not in (None, "waiting"):
        assert message[0] in (1, 2)
        error = message[2] if message[0] == 1 else message[2][0]
        assert error is None or not PYTHON_WORDS.search(error["message"]), error


def test_after_the_fuzzing_everything_is_free(server):
    with Client("127.0.0.1", server.port) as c:
        assert c.generate("Zoo", max_tokens=3).completion_tokens == 3
    wait_until_idle(server)
