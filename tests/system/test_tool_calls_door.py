"""Tool calling through the HTTP door and the official `openai` SDK, on the bundled model and on a random
one, both with a Qwen-style template that has tools (tests/golden/chat_templates/tools.jinja): every call
returned under tool_choice "required", a named function or "auto" parses and validates (jsonschema),
streamed or not; tool messages render back; bad tools are a 400 naming the field. The negative control:
the same sampling without the constraint gives calls that do not parse or validate."""

import json
import shutil
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("aiohttp")
pytest.importorskip("llguidance", reason="tool calls need the structured extra (llguidance)")
jsonschema = pytest.importorskip("jsonschema", reason="the schema checks need jsonschema (the test extra)")
from test_http import API_KEY, launch, raw  # noqa: E402

from minisarathi.bench.random_model import write_random_model  # noqa: E402
from minisarathi.llm import LLM  # noqa: E402
from minisarathi.paths import default_model_dir  # noqa: E402
from minisarathi.sampling_params import SamplingParams  # noqa: E402
from minisarathi.server.chat_template import load_chat_template  # noqa: E402
from minisarathi.server.tool_calls import FORMATS, ToolCallParser, ToolFormat, parse_tools  # noqa: E402

pytestmark = pytest.mark.system

TEMPLATE = Path(__file__).resolve().parents[1] / "golden" / "chat_templates" / "tools.jinja"
# small: the bundled model's context is 512 tokens, and its tokenizer spells JSON in ~2 characters a token
SCHEMAS = {
    "weather": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 12},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        },
        "required": ["city", "days"],
        "additionalProperties": False,
    },
    "search": {
        "type": "object",
        "properties": {"q": {"type": "string", "maxLength": 16}},
        "required": ["q"],
        "additionalProperties": False,
    },
}
TOOLS = [
    {"type": "function", "function": {"name": name, "parameters": schema}} for name, schema in SCHEMAS.items()
]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
MAX_TOKENS = 120


@pytest.fixture(scope="module", params=["bundled", "random"])
def model_dir(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    if request.param == "bundled":
        for f in default_model_dir().iterdir():
            shutil.copy(f, folder / f.name)
    else:  # random weights over the bundled tokenizer
        write_random_model(
            folder, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128
        )
    shutil.copy(TEMPLATE, folder / "chat_template.jinja")
    return folder


@pytest.fixture(scope="module")
def server(model_dir):
    args = ("--http-port", "0", "--served-model-name", "m", "--num-kv-blocks", "512")
    with launch(*args, model_dir=model_dir) as s:
        s.client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{s.http_port}/v1", api_key=API_KEY, max_retries=0
        )
        yield s


def valid(name: str, arguments: str) -> None:
    assert name in SCHEMAS
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def create(server, **fields):
    return server.client.chat.completions.create(
        model="m",
        messages=fields.pop("messages", MESSAGES),
        max_tokens=fields.pop("max_tokens", MAX_TOKENS),
        tools=TOOLS,
        **fields,
    )


def streamed_calls(server, **fields) -> tuple[dict, str, str | None]:
    """The calls ({index: [name, arguments]}), content and finish reason of a streamed answer, checking
    OpenAI's order: a call's first delta has its id and name, the later ones argument fragments only."""
    calls, content, reason = {}, "", None
    for chunk in create(server, stream=True, **fields):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        reason = choice.finish_reason or reason
        for call in choice.delta.tool_calls or ():
            if call.index not in calls:
                assert call.id.startswith("call_") and call.type == "function" and call.function.name
                calls[call.index] = [call.function.name, call.function.arguments or ""]
            else:
                assert call.id is None and call.function.name is None
                calls[call.index][1] += call.function.arguments
    return calls, content, reason


def test_required_always_returns_valid_calls_streamed_or_not(server):
    """One call always ends in time and validates; parallel calls may run on to max_tokens (a random model
    seldom stops), and then each call before the cut one validates."""
    for parallel, temperature in [(False, 0), (False, 1.0), (True, 0), (True, 1.0)]:
        fields = dict(tool_choice="required", parallel_tool_calls=parallel, temperature=temperature, seed=3)
        result = create(server, n=4, **fields)
        for choice in result.choices:
            assert choice.finish_reason == "tool_calls" or parallel and choice.finish_reason == "length"
            calls = choice.message.tool_calls
            assert choice.message.content is None and (len(calls) == 1 or parallel)
            for call in calls[: -1 if choice.finish_reason == "length" else None]:
                assert call.type == "function" and call.id.startswith("call_")
                valid(call.function.name, call.function.arguments)
        calls, content, reason = streamed_calls(server, **fields)
        assert content == "" and (reason == "tool_calls" or parallel and reason == "length")
        for name, arguments in list(calls.values())[: -1 if reason == "length" else None]:
            valid(name, arguments)


def test_a_stream_gives_the_same_calls_as_the_whole_answer(server):
    whole = create(server, tool_choice="required", temperature=0).choices[0].message.tool_calls
    calls, _, _ = streamed_calls(server, tool_choice="required", temperature=0)
    assert [[c.function.name, c.function.arguments] for c in whole] == [calls[i] for i in sorted(calls)]


def test_a_named_function_and_one_call_only(server):
    result = create(
        server,
        tool_choice={"type": "function", "function": {"name": "search"}},
        parallel_tool_calls=False,
        temperature=1.0,
        n=4,
        seed=5,
    )
    for choice in result.choices:
        (call,) = choice.message.tool_calls
        assert call.function.name == "search"
        valid("search", call.function.arguments)


def test_auto_at_temperature_gives_text_or_valid_calls(server):
    for stream in (False, True):
        for seed in range(3):
            if stream:
                calls, content, reason = streamed_calls(server, temperature=1.0, seed=seed)
            else:
                message = create(server, temperature=1.0, seed=seed).choices[0].message
                calls = {
                    i: [c.function.name, c.function.arguments] for i, c in enumerate(message.tool_calls or [])
                }
            for name, arguments in calls.values():
                valid(name, arguments)


def test_tool_messages_render_back_and_bad_tools_are_refused(server):
    conversation = MESSAGES + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "weather", "arguments": '{"city": "Paris", "days": 1}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    result = create(server, messages=conversation, tool_choice="none", temperature=0, max_tokens=5)
    assert result.choices[0].message.tool_calls is None
    body = {"model": "m", "messages": MESSAGES, "tools": TOOLS}
    bad = {
        **conversation[1],
        "tool_calls": [{**conversation[1]["tool_calls"][0], "function": {"name": "x", "arguments": "{"}}],
    }
    for change, param in [
        ({"tools": [{"type": "function"}]}, "tools[0]"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "intger"}}}]},
            "tools[0].function.parameters",
        ),
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
        ({"tool_choice": "always"}, "tool_choice"),
        ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"messages": MESSAGES + [bad]}, "messages[1].tool_calls[0].function.arguments"),
    ]:
        status, _, answer = raw(server, "POST", "/v1/chat/completions", {**body, **change})
        assert status == 400 and answer["error"]["param"] == param, (change, answer)
    assert raw(server, "GET", "/health")[0] == 200


def test_without_the_constraint_calls_do_not_validate(model_dir):
    """The negative control, offline on the same model and prompt: "required" sampling with the grammar off
    gives text the parser finds no valid call in; with it on, every choice is a valid call."""
    template = load_chat_template(model_dir)
    llm = LLM(model_dir, num_kv_blocks=512)
    prompt = llm.engine.tokenizer.encode(template.render(MESSAGES, tools=TOOLS), add_special_tokens=False)
    _, spec = parse_tools(
        {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False},
        ToolFormat(FORMATS["hermes"], None),
    )
    counts = []
    for structured in (None, spec):
        params = SamplingParams(temperature=1.0, n=8, seed=0, max_tokens=MAX_TOKENS, structured=structured)
        good = 0
        for choice in llm.generate([prompt], params)[0].outputs:
            parser = ToolCallParser(FORMATS["hermes"])
            events = parser.feed(choice.text) + parser.finish()
            names = [e[2] for e in events if e[0] == "call"]
            arguments = "".join(e[2] for e in events if e[0] == "arguments")
            try:
                (name,) = names
                valid(name, arguments)
                good += 1
            except (ValueError, AssertionError, jsonschema.ValidationError):
                pass
        counts.append(good)
    assert counts == [0, 8]


def test_a_template_without_a_format_needs_the_parser_flag(tmp_path):
    """chatml.jinja shows no call format: tools are a 400 naming `tools`, until --tool-call-parser names one
    (llama3_json here: the calls come back from that format's text)."""
    for f in default_model_dir().iterdir():
        shutil.copy(f, tmp_path / f.name)
    shutil.copy(TEMPLATE.with_name("chatml.jinja"), tmp_path / "chat_template.jinja")
    body = {"model": "m", "messages": MESSAGES, "tools": TOOLS, "max_tokens": MAX_TOKENS, "temperature": 0}
    for flags in ((), ("--tool-call-parser", "llama3_json")):
        args = ("--http-port", "0", "--served-model-name", "m", "--num-kv-blocks", "512", *flags)
        with launch(*args, model_dir=tmp_path) as s:
            status, _, answer = raw(s, "POST", "/v1/chat/completions", {**body, "tool_choice": "required"})
            if not flags:
                assert status == 400 and answer["error"]["param"] == "tools"
                assert "--tool-call-parser" in answer["error"]["message"]
                status, _, answer = raw(s, "POST", "/v1/chat/completions", {**body, "tool_choice": "none"})
                assert status == 200 and "tool_calls" not in answer["choices"][0]["message"]
                continue
            assert status == 200, answer
            choice = answer["choices"][0]
            assert choice["finish_reason"] in ("tool_calls", "length") and choice["message"]["tool_calls"]
            call = choice["message"]["tool_calls"][0]["function"]
            valid(call["name"], call["arguments"])
