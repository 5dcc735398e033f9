"""The Messages adapter on plain dicts: Anthropic's turns, system, tools and tool_choice become the chat
door's (checked by comparing against the chat request written by hand), errors name Anthropic's fields,
and the event stream keeps Anthropic's order whatever way the text is split."""

import asyncio
import json
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("llguidance", reason="tools need the structured extra (llguidance)")
from minisarathi.outputs import CompletionOutput  # noqa: E402
from minisarathi.server.anthropic_api import EventStream, error_body, error_status, parse_messages  # noqa: E402
from minisarathi.server.openai_api import DoorLimits, OpenAIError, parse_chat  # noqa: E402
from minisarathi.server.tool_calls import FORMATS, ToolFormat  # noqa: E402

LIMITS = DoorLimits(max_prompt_tokens=512, max_tokens=64, max_n=4, vocab_size=512)
HERMES = ToolFormat(FORMATS["hermes"], None)
SCHEMA = {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}
TOOL = {"name": "search", "description": "find", "input_schema": SCHEMA}
CHAT_TOOL = {"type": "function", "function": {"name": "search", "description": "find", "parameters": SCHEMA}}


def messages(**body):
    return parse_messages({"model": "m", "max_tokens": 8, **body}, "m", LIMITS, HERMES)


def test_turns_system_and_tools_become_the_chat_request():
    turns = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "let me look"},
                {"type": "tool_use", "id": "toolu_1", "name": "search", "input": {"q": "x"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "found", "cache_control": {}},
                {"type": "text", "text": "thanks"},
            ],
        },
    ]
    got = messages(
        messages=turns,
        system=[{"type": "text", "text": "sys"}],
        tools=[TOOL],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        stop_sequences=["END"],
        top_k=5,
        metadata={"user_id": "u"},
    )
    call = {"id": "toolu_1", "type": "function", "function": {"name": "search", "arguments": '{"q": "x"}'}}
    want = parse_chat(
        {
            "model": "m",
            "max_tokens": 8,
            "messages": [
                {"role": "system", "content": "sys"},
                {"role": "user", "content": "a\nb"},
                {"role": "assistant", "content": "let me look", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "toolu_1", "content": "found"},
                {"role": "user", "content": "thanks"},
            ],
            "tools": [CHAT_TOOL],
            "tool_choice": "required",
            "parallel_tool_calls": False,
            "stop": ["END"],
            "top_k": 5,
        },
        "m",
        LIMITS,
        HERMES,
    )
    assert got.messages == want.messages and got.tools == want.tools and got.params == want.params


def test_tool_choices_map_to_the_chat_ones():
    for choice, want in [
        ({"type": "auto"}, "auto"),
        ({"type": "none"}, "none"),
        ({"type": "tool", "name": "search"}, {"type": "function", "function": {"name": "search"}}),
    ]:
        got = messages(messages=[{"role": "user", "content": "q"}], tools=[TOOL], tool_choice=choice)
        chat = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "q"}]}
        expected = parse_chat({**chat, "tools": [CHAT_TOOL], "tool_choice": want}, "m", LIMITS, HERMES)
        assert got.tools == expected.tools and got.params == expected.params, choice


@pytest.mark.parametrize(
    "change, name",
    [
        ({"max_tokens": None}, "max_tokens"),
        ({"model": None}, "model"),
        ({"thinking": {"type": "enabled"}}, "thinking"),
        ({"stop_sequences": ["a"] * 1000}, "stop_sequences"),
        ({"tools": [{**TOOL, "input_schema": {"type": "intger"}}]}, "tools[0].input_schema"),
        ({"tools": [{**TOOL, "name": "a b"}]}, "tools[0].name"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0]"),
        ({"tools": [TOOL], "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name"),
        ({"tools": [TOOL], "tool_choice": {"type": "required"}}, "tool_choice"),
        ({"system": 3}, "system"),
        ({"messages": [{"role": "user", "content": [{"type": "tool_use"}]}]}, "messages[0].content[0]"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]},
            "messages[0].content[0]",
        ),
    ],
)
def test_errors_name_anthropics_fields(change, name):
    body = {"messages": [{"role": "user", "content": "q"}], **change}
    with pytest.raises(OpenAIError) as e:
        messages(**body)
    assert e.value.status == 400 and e.value.param == name
    error = error_body(e.value)["error"]
    assert error["type"] == "invalid_request_error" and name in error["message"]


def test_error_types_by_status():
    kinds = {
        401: "authentication_error",
        404: "not_found_error",
        429: "rate_limit_error",
        503: "overloaded_error",
        500: "api_error",
    }
    for status, kind in kinds.items():
        assert error_body(OpenAIError(status, "x"))["error"]["type"] == kind
    full = OpenAIError(429, "queue full", code="overloaded")  # the engine's queue, not a key's quota
    assert error_body(full)["error"]["type"] == "overloaded_error" and error_status(full) == 529
    assert error_status(OpenAIError(429, "over quota", code="rate_limit_exceeded")) == 429


def order(events: list[dict]) -> list[str]:
    return [e["type"] + (f":{e['index']}" if "index" in e else "") for e in events]


def test_the_event_stream_keeps_anthropics_order_however_the_text_is_split():
    """Text then two calls: one text block and two tool_use blocks, each opened, fed and closed in turn,
    the arguments' fragments joining to the calls' JSON, for every split of the output into two pieces."""
    request = messages(messages=[{"role": "user", "content": "q"}], tools=[TOOL])
    text = 'hi <tool_call>\n{"name": "search", "arguments": {"q": "a"}}\n</tool_call>\n'
    text += '<tool_call>\n{"name": "search", "arguments": {"q": "b"}}\n</tool_call>'
    done = CompletionOutput(0, text, [1, 2, 3], finish_reason="stop")
    for cut in range(len(text) + 1):
        stream = EventStream("msg_1", request, 4)
        events = (
            stream.start + stream.events(text[:cut], None, done) + stream.events(text[cut:], "stop", done)
        )
        kinds = [k for k in order(events) if not k.startswith("content_block_delta")]
        assert kinds == [
            "message_start",
            "ping",
            "content_block_start:0",
            "content_block_stop:0",
            "content_block_start:1",
            "content_block_stop:1",
            "content_block_start:2",
            "content_block_stop:2",
            "message_delta",
            "message_stop",
        ], cut
        parts = {0: "", 1: "", 2: ""}
        for e in events:
            if e["type"] == "content_block_delta":
                delta = e["delta"]
                parts[e["index"]] += delta.get("text", delta.get("partial_json", ""))
        assert parts == {0: "hi ", 1: '{"q": "a"}', 2: '{"q": "b"}'}, cut
        assert events[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
        assert events[-2]["usage"] == {"output_tokens": 3}


def test_an_engine_error_mid_stream_is_an_error_event():
    """A stream whose request fails after its first text (the server shutting down): the events so far,
    then Anthropic's error event, and no message_stop that would claim the answer complete."""
    pytest.importorskip("aiohttp")
    from minisarathi.outputs import RequestOutput
    from minisarathi.server.anthropic_api import write_events
    from minisarathi.server.http import _Choice, _from_rpc
    from minisarathi.server.protocol import ABORTED, RPCError

    request = messages(messages=[{"role": "user", "content": "q"}], stream=True)
    request.prompts = [[1, 2, 3]]
    choice = _Choice(0, 0, 0, "http:msg_1", stream=True)
    choice.receive(RequestOutput("msg_1", None, [1, 2, 3], [CompletionOutput(0, "Once", [5])], False))
    choice.receive(RPCError(ABORTED, "the server is shutting down"))
    call = SimpleNamespace(choices=[choice], request=request, request_id="msg_1", wake=asyncio.Event())
    sent = []

    async def send(data: bytes) -> None:
        sent.append(data)

    asyncio.run(write_events(call, send, _from_rpc))
    events = [e.split("\n") for e in b"".join(sent).decode().split("\n\n") if e]
    assert [name for name, _ in events] == [
        "event: message_start",
        "event: ping",
        "event: content_block_start",
        "event: content_block_delta",
        "event: error",
    ]
    error = json.loads(events[-1][1].removeprefix("data: "))
    assert error == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": "the server is shutting down"},
    }


_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-3, 3)
    | st.sampled_from(["", "text", "tool_use", "tool_result", "user"]),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(
            st.sampled_from(
                ["type", "text", "role", "content", "id", "name", "input", "tool_use_id", "input_schema"]
            ),
            inner,
            max_size=4,
        )
    ),
    max_leaves=12,
)


_TURNS = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "assistant"]), "content": _JSON | st.lists(_JSON)}
    ),
    max_size=3,
)


@settings(max_examples=400, deadline=None)
@given(
    _TURNS,
    st.dictionaries(
        st.sampled_from(["system", "tools", "tool_choice", "stop_sequences", "top_k", "stream"]), _JSON
    ),
)
def test_any_json_is_taken_or_refused_as_a_400(turns, fields):
    """Whatever JSON a client sends in the fields and turns, the adapter answers a request or a 400, never a
    crash (which the door would answer as a 500)."""
    try:
        messages(messages=turns + [{"role": "user", "content": "q"}], **fields)
    except OpenAIError as e:
        assert e.status == 400 and error_body(e)["error"]["message"]
