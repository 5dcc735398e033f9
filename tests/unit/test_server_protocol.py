"""protocol.py on its own: generate's param checks and the unpacker's size limits (no server needed)."""

import msgpack
import pytest

from minisarathi.sampling_params import SamplingParams
from minisarathi.server.protocol import (
    INVALID_PARAMS,
    RPCError,
    ServerLimits,
    make_unpacker,
    pack,
    parse_generate,
    single_param,
    text_params,
    token_id_list,
)

LIMITS = ServerLimits(max_message_bytes=4096, max_tokens=100)


def test_generate_params_become_sampling_params():
    request = parse_generate(
        [{"prompt": "hi", "max_tokens": 7, "temperature": 0, "stop": ["x"], "seed": 3, "stream": True}],
        LIMITS,
    )
    assert request.prompt == "hi" and request.prompt_token_ids is None and request.stream
    assert request.params.max_tokens == 7 and request.params.greedy and request.params.stop == ["x"]
    assert parse_generate([{"prompt_token_ids": [1, 5]}], LIMITS).prompt_token_ids == [1, 5]
    assert (
        request.priority is None and parse_generate([{"prompt": "a", "priority": -3}], LIMITS).priority == -3
    )
    assert parse_generate([{"prompt": "a", "priority": 2.0}], LIMITS).priority == 2


@pytest.mark.parametrize(
    "fields, named",
    [
        ({"prompt": "hi", "bogus": 1}, "bogus"),
        ({"prompt": 5}, "prompt"),
        ({"prompt_token_ids": [1, -2]}, "prompt_token_ids"),
        ({"prompt_token_ids": "abc"}, "prompt_token_ids"),
        ({}, "prompt"),
        ({"prompt": "a", "prompt_token_ids": [1]}, "prompt"),
        ({"prompt": "a", "max_tokens": "8"}, "max_tokens"),
        ({"prompt": "a", "max_tokens": 101}, "max_tokens"),
        ({"prompt": "a", "temperature": -1.0}, "temperature"),
        ({"prompt": "a", "stop": 3}, "stop"),
        ({"prompt": "a", "stop_token_ids": [1.5]}, "stop_token_ids"),
        ({"prompt": "a", "stream": 1}, "stream"),
        ({"prompt": "a", "ignore_eos": "yes"}, "ignore_eos"),
        ({"prompt": "a", "skip_special_tokens": 1}, "skip_special_tokens"),
        ({"prompt": None}, "prompt"),
        ({"prompt": "a", "priority": "high"}, "priority"),
        ({"prompt": "a", "priority": 1.5}, "priority"),
        ({"prompt": "a", "priority": 2**40}, "priority"),
    ],
)
def test_bad_generate_params_name_the_field(fields, named):
    with pytest.raises(RPCError) as info:
        parse_generate([fields], LIMITS)
    assert info.value.code == INVALID_PARAMS and named in info.value.message


def test_generate_params_are_a_map_or_positional():
    assert parse_generate(["hi"], LIMITS).prompt == "hi"
    request = parse_generate([[1, 5], {"max_tokens": 3}], LIMITS)
    assert request.prompt_token_ids == [1, 5] and request.params.max_tokens == 3
    for params in (
        [],
        [5],
        [{"prompt": "a"}, {"prompt": "b"}],
        ["a", "b"],
        ["a", {"prompt": "b"}],
        ["a", {}, {}],
    ):
        with pytest.raises(RPCError) as info:
            parse_generate(params, LIMITS)
        assert info.value.code == INVALID_PARAMS


def test_nil_fields_take_their_defaults():
    request = parse_generate(
        [
            {
                "prompt": "a",
                "prompt_token_ids": None,
                "max_tokens": None,
                "temperature": None,
                "stop": None,
                "seed": None,
                "stream": None,
                "skip_special_tokens": None,
            }
        ],
        LIMITS,
    )
    assert request.prompt == "a" and not request.stream and request.params == SamplingParams()


def test_integral_floats_are_ints():
    request = parse_generate(
        [
            {
                "prompt_token_ids": [1.0, 5.0],
                "max_tokens": 7.0,
                "top_k": 2.0,
                "stop_token_ids": [3.0],
                "temperature": 1,
            }
        ],
        LIMITS,
    )
    assert request.prompt_token_ids == [1, 5] and request.params.max_tokens == 7 and request.params.top_k == 2
    assert request.params.stop_token_ids == [3] and all(type(t) is int for t in request.prompt_token_ids)
    assert single_param([4.0], "msgid", int) == 4
    for fields, named in (
        ({"prompt": "a", "max_tokens": 7.5}, "max_tokens"),
        ({"prompt_token_ids": [1.5]}, "prompt_token_ids"),
    ):
        with pytest.raises(RPCError, match=named):
            parse_generate([fields], LIMITS)


def test_text_sent_as_bin_is_text():
    params = text_params([{b"prompt": b"hi", b"stop": [b"x", "y"], "prompt_token_ids": [1, 2]}, b"abc", 5])
    assert params == [{"prompt": "hi", "stop": ["x", "y"], "prompt_token_ids": [1, 2]}, "abc", 5]
    assert parse_generate(text_params([{b"prompt": b"hi"}]), LIMITS).prompt == "hi"
    request = parse_generate(text_params([{"prompt": "hi", "logit_bias": {b"407": -100}}]), LIMITS)
    assert request.params.logit_bias == {407: -100.0}
    with pytest.raises(RPCError, match="prompt"):
        text_params([{"prompt": b"\xff"}])


def test_error_messages_quote_at_most_a_little_of_the_input():
    with pytest.raises(RPCError) as info:
        parse_generate([{"prompt": "a", "x" * 100_000: 1}], LIMITS)
    assert len(info.value.message) < 300


def test_single_param_takes_bare_or_named():
    assert single_param(["hello"], "text", str) == "hello"
    assert single_param([{"text": "hello"}], "text", str) == "hello"
    for params in ([], [1], [{"txt": "a"}], ["a", "b"]):
        with pytest.raises(RPCError):
            single_param(params, "text", str)
    with pytest.raises(RPCError):
        single_param([True], "msgid", int)  # a bool is not a msgid


def test_unpacker_rejects_a_huge_array_header_without_allocating():
    unpacker = make_unpacker(LIMITS.max_message_bytes)
    unpacker.feed(b"\xdd\xff\xff\xff\xff")  # array32 claiming 4 billion elements
    with pytest.raises(ValueError):
        list(unpacker)


def test_unpacker_caps_a_huge_string_at_the_buffer():
    unpacker = make_unpacker(LIMITS.max_message_bytes)
    unpacker.feed(b"\xdb\xff\xff\xff\xff")  # str32 claiming 4 GiB: waits for bytes ...
    assert list(unpacker) == []
    with pytest.raises(msgpack.BufferFull):  # ... but never buffers more than the limit allows
        for _ in range(4):
            unpacker.feed(b"a" * LIMITS.max_message_bytes)


def test_pack_round_trips_numpy_scalars():
    import numpy as np

    assert msgpack.unpackb(pack({"a": np.int64(3), "b": np.float32(0.5)})) == {"a": 3, "b": 0.5}


def test_limits_must_be_positive():
    with pytest.raises(ValueError, match="max_tokens"):
        ServerLimits(max_tokens=0)


def test_a_connection_past_its_write_buffer_cap_is_dropped():
    from types import SimpleNamespace

    from minisarathi.server.msgpack_door import _Connection

    class Transport:  # the kernel takes nothing: everything written stays buffered
        buffered, aborted = 0, False

        def get_write_buffer_size(self):
            return self.buffered

        def abort(self):
            self.aborted = True

    transport = Transport()

    def write(data):
        transport.buffered += len(data)

    conn = _Connection(
        0,
        SimpleNamespace(write=write, transport=transport),
        ServerLimits(max_write_buffer_bytes=1000),
        authenticated=True,
    )
    conn.respond(1, None, "x" * 500)
    assert not conn.closed and not transport.aborted
    conn.respond(2, None, "x" * 500)  # 1000+ bytes now wait: dropped, not buffered further
    assert conn.closed and transport.aborted
    conn.respond(3, None, "x" * 500)
    assert transport.buffered < 1100


def test_a_corked_connection_writes_what_was_sent_in_one_piece_in_order():
    """cork()/uncork(): the messages sent between them reach the transport as one write holding the same
    bytes, in the same order, as unheld sends would; a flushing close writes them first; the write-buffer cap
    is still enforced on that write; an aborting close drops them."""
    from types import SimpleNamespace

    from minisarathi.server.msgpack_door import _Connection
    from minisarathi.server.protocol import pack

    class Transport:
        buffered, aborted = 0, False

        def get_write_buffer_size(self):
            return self.buffered

        def abort(self):
            self.aborted = True

    def connection(cap=1 << 20, kernel_takes_all=False):
        transport, writes = Transport(), []

        def write(data):
            writes.append(data)
            transport.buffered += 0 if kernel_takes_all else len(data)

        conn = _Connection(
            0,
            SimpleNamespace(write=write, transport=transport, close=lambda: None),
            ServerLimits(max_write_buffer_bytes=cap),
            authenticated=True,
        )
        return conn, transport, writes

    messages = [
        [2, "chunk", [1, {"text": "a", "token_ids": [5]}]],
        [1, 1, None, "done"],
        [2, "chunk", [2, {}]],
    ]
    conn, _, writes = connection()
    conn.cork()
    conn.send(messages[0])
    conn.respond(1, None, "done")
    conn.send(messages[2])
    assert writes == []
    conn.uncork()
    assert writes == [b"".join(pack(m) for m in messages)]
    conn.send(messages[0])  # uncorked: written at once
    assert writes[-1] == pack(messages[0])

    conn, transport, writes = connection(kernel_takes_all=True)
    conn.cork()
    conn.send(messages[1])
    conn.close(flush=True)
    assert writes == [pack(messages[1])] and conn.closed and not transport.aborted

    conn, transport, writes = connection(cap=100)
    conn.cork()
    conn.respond(1, None, "x" * 60)
    conn.respond(2, None, "x" * 60)
    conn.uncork()
    assert conn.closed and transport.aborted  # 120+ bytes waiting: over the cap

    conn, transport, writes = connection()
    conn.cork()
    conn.send(messages[1])
    conn.close()
    conn.uncork()
    assert writes == [] and transport.aborted


@pytest.mark.parametrize(
    "values, expected",
    [
        ([], []),
        ([0, 511, 7], [0, 511, 7]),
        ([1.0, 2, 3.0], [1, 2, 3]),  # integral floats, as some encoders send
        ([1.5], None),
        ([1.0, 1.5], None),
        ([-1], None),
        ([512], None),
        ([2.0, 512.0], None),
        ([True], None),
        ([1.0, True], None),
        (["1"], None),
        ([1, None], None),
    ],
)
def test_token_id_lists_are_ints_in_the_vocabulary(values, expected):
    if expected is None:
        with pytest.raises(RPCError, match=r"token_ids must be integers in \[0, 512\)"):
            token_id_list(values, "token_ids", 512)
    else:
        result = token_id_list(values, "token_ids", 512)
        assert result == expected and all(type(t) is int for t in result)


def test_stop_token_ids_past_int64_are_an_invalid_params_error():
    """An id of 2**63 or more (msgpack carries up to 2**64 - 1) overflowed the sampler's int64 array: an
    internal error with a traceback in the log, where it is the client's invalid parameter."""
    with pytest.raises(RPCError) as error:
        parse_generate([{"prompt": "hi", "stop_token_ids": [2**63]}], LIMITS)
    assert error.value.code == INVALID_PARAMS and "stop_token_ids" in error.value.message
    assert parse_generate(
        [{"prompt": "hi", "stop_token_ids": [2**63 - 1]}], LIMITS
    ).params.stop_token_ids == [2**63 - 1]


def test_limits_are_positive_except_the_drain_delay_which_may_be_zero():
    assert ServerLimits(drain_delay_s=0).drain_delay_s == 0
    for bad in ({"drain_delay_s": -1}, {"shutdown_grace_s": 0}, {"max_n": True}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            ServerLimits(**bad)
