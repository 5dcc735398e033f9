"""The Anthropic Messages door (/v1/messages) through the official `anthropic` SDK, on the bundled model
and a random one, both with a Qwen-style template that has tools (tests/golden/chat_templates/tools.jinja):
greedy answers equal the chat door's for the same conversation (system, tool_use and tool_result turns
rendered through the same template), stop reasons and usage, the stream's events in Anthropic's strict
order and its final message, tool_choice "any" always giving a tool_use whose input validates
(jsonschema), streamed or not, and errors in Anthropic's shape."""

import http.client
import json

import pytest

anthropic = pytest.importorskip("anthropic")
pytest.importorskip("aiohttp")
pytest.importorskip("llguidance", reason="tool calls need the structured extra (llguidance)")
jsonschema = pytest.importorskip("jsonschema", reason="the schema checks need jsonschema (the test extra)")
from test_http import API_KEY, launch, raw  # noqa: E402
from test_tool_calls_door import SCHEMAS, model_dir  # noqa: E402, F401 (the bundled and a random model)

pytestmark = pytest.mark.system

TOOLS = [{"name": name, "description": f"the {name} tool", "input_schema": s} for name, s in SCHEMAS.items()]
CHAT_TOOLS = [
    {"type": "function", "function": {"name": t["name"], "parameters": t["input_schema"]}} for t in TOOLS
]
QUESTION = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def server(model_dir):  # noqa: F811 (the imported fixture)
    args = ("--http-port", "0", "--served-model-name", "m", "--num-kv-blocks", "512")
    with launch(*args, model_dir=model_dir) as s:
        s.client = anthropic.Anthropic(
            base_url=f"http://127.0.0.1:{s.http_port}", api_key=API_KEY, max_retries=0
        )
        yield s


def sdk_fields(fields: dict) -> dict:
    """The SDK's own arguments; the sampling fields it no longer names (2.x) go in extra_body, as a
    client sends them."""
    extra = {k: fields.pop(k) for k in ("temperature", "top_p", "top_k") if k in fields}
    fields.setdefault("messages", [{"role": "user", "content": QUESTION}])
    return {"model": "m", "max_tokens": fields.pop("max_tokens", 24), "extra_body": extra, **fields}


def create(server, **fields):
    return server.client.messages.create(**sdk_fields(fields))


def chat(server, messages, **fields) -> dict:
    status, _, answer = raw(
        server, "POST", "/v1/chat/completions", {"model": "m", "messages": messages, **fields}
    )
    assert status == 200, answer
    return answer


def check_order(events) -> None:
    """Anthropic's event grammar: message_start, ping?, (content_block_start content_block_delta*
    content_block_stop)* with indexes 0, 1, ..., message_delta, message_stop."""
    types = [e.type for e in events]
    assert types[0] == "message_start" and types[-2:] == ["message_delta", "message_stop"], types
    body = types[2:-2] if types[1] == "ping" else types[1:-2]
    index = 0
    while body:
        assert body[0] == "content_block_start", types
        end = body.index("content_block_stop")
        assert set(body[1:end]) <= {"content_block_delta"}, types
        body = body[end + 1 :]
    blocks = [e for e in events if e.type.startswith("content_block")]
    for e in blocks:
        index += e.type == "content_block_start"
        assert e.index == index - 1, types


def streamed(server, **fields):
    with server.client.messages.stream(**sdk_fields(fields)) as stream:
        events = list(stream)
        final = stream.get_final_message()
    check_order([e for e in events if e.type not in ("text", "input_json")])  # the SDK's own helper events
    return events, final


def blocks(message) -> list[tuple]:
    """A message's content without the ids (each answer gets new ones)."""
    return [(b.type, b.text) if b.type == "text" else (b.type, b.name, b.input) for b in message.content]


def test_text_system_and_usage_equal_the_chat_door(server):
    for system in (None, "You are a helpful bot.", [{"type": "text", "text": "Be brief."}]):
        fields = {} if system is None else {"system": system}
        message = create(server, temperature=0, **fields)
        prefix = (
            []
            if system is None
            else [{"role": "system", "content": system if isinstance(system, str) else "Be brief."}]
        )
        want = chat(server, prefix + [{"role": "user", "content": QUESTION}], max_tokens=24, temperature=0)
        assert message.id.startswith("msg_") and message.type == "message" and message.role == "assistant"
        assert [b.type for b in message.content] == ["text"]
        assert message.content[0].text == want["choices"][0]["message"]["content"]
        reason = {"stop": "end_turn", "length": "max_tokens"}[want["choices"][0]["finish_reason"]]
        assert message.stop_reason == reason and message.stop_sequence is None
        assert message.usage.input_tokens == want["usage"]["prompt_tokens"]
        assert message.usage.output_tokens == want["usage"]["completion_tokens"]


def test_max_tokens_and_stop_sequences(server):
    message = create(server, temperature=0, max_tokens=30)
    text = message.content[0].text
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 30
    word = text.split()[3]
    cut = create(server, temperature=0, max_tokens=30, stop_sequences=["zzz", word])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == word
    assert cut.content[0].text == text[: text.index(word)]


def test_a_stream_gives_the_whole_answer_and_its_final_message(server):
    for fields in ({}, {"stop_sequences": ["the"]}, {"max_tokens": 5}):
        whole = create(server, temperature=0, **fields)
        events, final = streamed(server, temperature=0, **fields)
        assert "".join(e.text for e in events if e.type == "text") == whole.content[0].text
        assert blocks(final) == blocks(whole) and final.stop_reason == whole.stop_reason
        assert final.stop_sequence == whole.stop_sequence and final.usage == whole.usage


def test_the_wire_has_event_lines_naming_each_event(server):
    """Anthropic's SSE: each event's `event:` line names its data's type (the SDK reads the data's)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
    body = {"model": "m", "max_tokens": 6, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    conn.request("POST", "/v1/messages", json.dumps(body), {"x-api-key": API_KEY})
    response = conn.getresponse()
    assert response.status == 200 and response.getheader("Content-Type").startswith("text/event-stream")
    events = [e for e in response.read().decode().split("\n\n") if e]
    conn.close()
    for event in events:
        name, data = event.split("\n")
        assert name == "event: " + json.loads(data.removeprefix("data: "))["type"]
    assert events[0].startswith("event: message_start") and events[-1].startswith("event: message_stop")


def valid_uses(message, parallel: bool) -> None:
    uses = [b for b in message.content if b.type == "tool_use"]
    assert message.stop_reason == "tool_use" or parallel and message.stop_reason == "max_tokens"
    assert uses and (len(uses) == 1 or parallel)
    for use in uses:
        assert use.id.startswith("toolu_") and use.name in SCHEMAS
        jsonschema.validate(use.input, SCHEMAS[use.name])


def test_tool_choice_any_always_gives_a_valid_tool_use_streamed_or_not(server):
    for parallel, temperature in [(False, 0), (False, 1.0), (True, 1.0)]:
        choice = {"type": "any", "disable_parallel_tool_use": not parallel}
        for seed in range(3):
            fields = dict(tools=TOOLS, tool_choice=choice, temperature=temperature, max_tokens=120)
            valid_uses(create(server, **fields), parallel)
            events, final = streamed(server, **fields)
            valid_uses(final, parallel)
            if temperature == 0:
                assert blocks(final) == blocks(create(server, **fields))
                break


def test_a_named_tool_and_a_tool_result_round_trip(server):
    message = create(
        server,
        tools=TOOLS,
        tool_choice={"type": "tool", "name": "search", "disable_parallel_tool_use": True},
        max_tokens=120,
    )
    (use,) = message.content
    assert use.name == "search"
    jsonschema.validate(use.input, SCHEMAS["search"])
    turns = [
        {"role": "user", "content": QUESTION},
        {
            "role": "assistant",
            "content": [
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "weather",
                    "input": {"city": "Paris", "days": 1},
                }
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_1",
                    "content": [{"type": "text", "text": "sunny"}],
                }
            ],
        },
    ]
    answer = create(
        server, messages=turns, tools=TOOLS, tool_choice={"type": "none"}, temperature=0, max_tokens=8
    )
    call = {
        "id": "toolu_1",
        "type": "function",
        "function": {"name": "weather", "arguments": json.dumps({"city": "Paris", "days": 1})},
    }
    want = chat(
        server,
        [
            turns[0],
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        ],
        tools=CHAT_TOOLS,
        tool_choice="none",
        temperature=0,
        max_tokens=8,
    )
    assert answer.content[0].text == want["choices"][0]["message"]["content"]
    assert answer.usage.input_tokens == want["usage"]["prompt_tokens"]
    without = create(
        server, messages=turns[:1] + [{"role": "user", "content": "sunny"}], temperature=0, max_tokens=8
    )
    assert without.usage.input_tokens != answer.usage.input_tokens  # the turns did reach the template


def test_errors_in_anthropic_shape(server):
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    for change, field in [
        ({"n": 2}, "n"),
        ({"max_tokens": None}, "max_tokens"),
        ({"stop_sequences": "x"}, "stop_sequences"),
        ({"tools": [{"name": "a b", "input_schema": {"type": "object"}}]}, "tools[0].name"),
        ({"tools": [{"name": "f", "input_schema": {"type": "intger"}}]}, "tools[0].input_schema"),
        ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "messages[0].content[0]",
        ),
        ({"messages": [{"role": "assistant", "content": "hi"}]}, "messages[0].role"),
    ]:
        status, _, answer = raw(server, "POST", "/v1/messages", {**body, **change})
        assert status == 400 and answer["type"] == "error", (change, answer)
        assert answer["error"]["type"] == "invalid_request_error" and field in answer["error"]["message"], (
            answer
        )
    with pytest.raises(anthropic.BadRequestError) as e:
        create(server, top_k="x")
    assert e.value.status_code == 400 and "top_k" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as e:
        server.client.messages.create(
            model="claude", max_tokens=4, messages=[{"role": "user", "content": "hi"}]
        )
    assert e.value.body["error"]["type"] == "not_found_error" and "claude" in e.value.body["error"]["message"]
    wrong = anthropic.Anthropic(base_url=server.client.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        wrong.messages.create(model="m", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert e.value.status_code == 401 and e.value.body["error"]["type"] == "authentication_error"
    status, _, answer = raw(
        server, "POST", "/v1/messages", body, headers={"Authorization": "", "x-api-key": API_KEY}
    )
    assert status == 200 and answer["type"] == "message"  # x-api-key alone is a key
    status, _, answer = raw(server, "POST", "/v1/chat/completions", {"model": "m"})
    assert status == 400 and "param" in answer["error"]  # the OpenAI door keeps its own shape
