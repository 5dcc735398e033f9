"""Tool calls on text: the three formats' parser, whole or split anywhere across stream pieces; the grammar
of each format and tool_choice, checked by llguidance over the bundled tokenizer (a valid call is taken,
bad arguments are not); the request fields, refused naming the field; the format told from a template."""

import json

import pytest

pytest.importorskip("llguidance", reason="tool calls need the structured extra (llguidance)")

from minisarathi import structured  # noqa: E402
from minisarathi.paths import default_model_dir  # noqa: E402
from minisarathi.sampling_params import SamplingParams  # noqa: E402
from minisarathi.server.openai_api import DoorLimits, OpenAIError, parse_chat  # noqa: E402
from minisarathi.server.tool_calls import (  # noqa: E402
    FORMATS,
    ToolCallParser,
    ToolError,
    ToolFormat,
    ToolRequest,
    detect_format,
    parse_tools,
    tool_message,
)
from minisarathi.tokenizer import Tokenizer  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "weather", "parameters": SCHEMA}},
    {"type": "function", "function": {"name": "now"}},
]
# the text each format's grammar writes for two calls, with content first where the format has room for it
ARGS = '{"city":"P}a{r\\"is","days":3}'  # braces and an escaped quote inside a string
CALLS = {
    "hermes": f'Let me look.\n<tool_call>\n{{"name": "weather", "arguments": {ARGS}}}\n</tool_call>\n'
    '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>',
    "llama3_json": f'{{"name": "weather", "parameters": {ARGS}}}; {{"name": "now", "parameters": {{}}}}',
    "mistral": f'Sure [TOOL_CALLS][{{"name": "weather", "arguments": {ARGS}}}, '
    '{"name": "now", "arguments": {}}]',
}
CONTENT = {"hermes": "Let me look.\n", "llama3_json": "", "mistral": "Sure "}
LIMITS = DoorLimits(max_prompt_tokens=512, max_tokens=64, max_n=4, vocab_size=512)


def merged(events: list[tuple]) -> list[tuple]:
    """Events with consecutive content, or one call's argument fragments, joined."""
    out = []
    for event in events:
        if out and event[0] != "call" and out[-1][:-1] == event[:-1]:
            out[-1] = (*event[:-1], out[-1][-1] + event[-1])
        else:
            out.append(event)
    return out


def parse(fmt: str, pieces: list[str]) -> list[tuple]:
    parser = ToolCallParser(FORMATS[fmt])
    events = [e for piece in pieces for e in parser.feed(piece)]
    return merged(events + parser.finish())


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_format_parses_whole_or_split_anywhere(fmt):
    text = CALLS[fmt]
    want = ([("content", CONTENT[fmt])] if CONTENT[fmt] else []) + [
        ("call", 0, "weather"),
        ("arguments", 0, ARGS),
        ("call", 1, "now"),
        ("arguments", 1, "{}"),
    ]
    assert parse(fmt, [text]) == want
    assert parse(fmt, list(text)) == want  # one character a piece
    for cut in range(1, len(text)):
        assert parse(fmt, [text[:cut], text[cut:]]) == want, cut


def test_content_is_streamed_as_it_comes_and_a_trigger_prefix_is_held_back():
    parser = ToolCallParser(FORMATS["hermes"])
    assert parser.feed("Hello <tool") == [("content", "Hello ")]  # "<tool" may be the trigger's start
    assert parser.feed("box> and") == [("content", "<toolbox> and")]
    assert parser.finish() == []


def test_text_that_only_looks_like_a_call_stays_content():
    for fmt, text in [
        ("hermes", '<tool_call>\n{"arguments": {}, "name": "f"}\n</tool_call> ok'),  # not name first
        ("mistral", "[TOOL_CALLS] no list"),
        ("llama3_json", '{"name": 3}'),
    ]:
        assert parse(fmt, [text]) == [("content", text)]
        assert parse(fmt, list(text)) == [("content", text)]


def test_a_call_cut_by_max_tokens_keeps_what_came():
    message, reason = tool_message(
        request("hermes"), '<tool_call>\n{"name": "now", "arguments": {"a', "length"
    )
    assert reason == "length" and message["content"] is None
    assert [c["function"] for c in message["tool_calls"]] == [{"name": "now", "arguments": '{"a'}]
    # a second call cut at its trigger's start is dropped, not content
    text = '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>\n<tool_'
    message, _ = tool_message(request("hermes"), text, "length")
    assert message["content"] is None and len(message["tool_calls"]) == 1


def request(fmt: str, choice="required", parallel=None):
    body = {"tools": TOOLS, "tool_choice": choice}
    if parallel is not None:
        body["parallel_tool_calls"] = parallel
    return parse_tools(body, ToolFormat(FORMATS[fmt], None))[0] or ToolRequest(
        TOOLS, ToolFormat(FORMATS[fmt], None), True
    )


def test_the_whole_answer_is_openais_message():
    message, reason = tool_message(request("hermes"), CALLS["hermes"], "stop")
    assert reason == "tool_calls" and message["content"] == CONTENT["hermes"]
    calls = message["tool_calls"]
    assert [c["function"] for c in calls] == [
        {"name": "weather", "arguments": ARGS},
        {"name": "now", "arguments": "{}"},
    ]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2
    assert tool_message(request("hermes"), "Just text.", "stop") == (
        {"role": "assistant", "content": "Just text."},
        "stop",
    )


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_pretrained(default_model_dir())


def accepts(tokenizer, spec: dict, text: str) -> bool:
    """Whether the grammar takes text and may end after it."""
    matcher = structured.matcher(SamplingParams(structured=spec), tokenizer, tokenizer.vocab_size)
    tokens = tokenizer.encode(text, add_special_tokens=False)
    if tokenizer.decode(tokens[:1]) == "":  # the sentencepiece "▁" a text starts with, not the model's
        tokens = tokens[1:]
    return matcher.try_consume_tokens(tokens) == len(tokens) and matcher.is_accepting()


def constraint(fmt: str, choice, parallel=None) -> dict:
    body = {"tools": TOOLS, "tool_choice": choice}
    if parallel is not None:
        body["parallel_tool_calls"] = parallel
    return parse_tools(body, ToolFormat(FORMATS[fmt], None))[1]


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_grammar_takes_valid_calls_only(tokenizer, fmt):
    calls = CALLS[fmt][len(CONTENT[fmt]) :]
    one = {
        "hermes": '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>',
        "llama3_json": '{"name": "now", "parameters": {}}',
        "mistral": '[TOOL_CALLS][{"name": "now", "arguments": {}}]',
    }[fmt]
    bad_arguments = one.replace("{}", '{"x":1}')
    required = constraint(fmt, "required")
    assert accepts(tokenizer, required, calls) and accepts(tokenizer, required, one)
    assert not accepts(tokenizer, required, bad_arguments)
    assert not accepts(tokenizer, required, "Hello")
    assert not accepts(tokenizer, constraint(fmt, "required", parallel=False), calls)
    named = constraint(fmt, {"type": "function", "function": {"name": "now"}})
    assert accepts(tokenizer, named, one) and not accepts(tokenizer, named, calls)
    auto = constraint(fmt, "auto")
    assert accepts(tokenizer, auto, "Once upon a time.")
    assert accepts(tokenizer, auto, CALLS[fmt])  # content, then the calls
    assert not accepts(tokenizer, auto, bad_arguments)
    assert constraint(fmt, "none") is None


def test_bad_tools_are_refused_naming_the_field():
    fmt = ToolFormat(FORMATS["hermes"], None)
    for body, param in [
        ({"tools": "x"}, "tools"),
        ({"tools": [{"type": "function"}]}, "tools[0]"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
        ({"tools": [TOOLS[1], TOOLS[1]]}, "tools[1].function.name"),
        ({"tools": [{"type": "function", "function": {"name": "f", "x": 1}}]}, "tools[0].function"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "intger"}}}]},
            "tools[0].function.parameters",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
            "tools[0].function.parameters",
        ),
        ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice.function.name",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "parallel_tool_calls": 1}, "parallel_tool_calls"),
    ]:
        with pytest.raises(ToolError) as error:
            parse_tools(body, fmt)
        assert error.value.param == param, body
    with pytest.raises(ToolError, match="--tool-call-parser") as error:  # a template with no format told
        parse_tools({"tools": TOOLS}, None)
    assert error.value.param == "tools"
    assert parse_tools({"tools": TOOLS, "tool_choice": "none"}, None) == (None, None)


def test_chat_requests_take_tool_messages_and_refuse_two_constraints():
    call = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": ARGS}}
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    fmt = ToolFormat(FORMATS["hermes"], None)
    request = parse_chat({"messages": messages, "tools": TOOLS}, "m", LIMITS, fmt)
    # as transformers' templates read them: the arguments an object
    assert request.messages[1] == {
        "role": "assistant",
        "tool_calls": [{**call, "function": {"name": "weather", "arguments": json.loads(ARGS)}}],
    }
    assert request.messages[2] == messages[2]
    assert request.tools.tools == TOOLS and request.params.grammar is not None
    assert (
        parse_chat({"messages": messages, "tools": TOOLS, "tool_choice": "none"}, "m", LIMITS, fmt).tools
        is None
    )
    for body, param in [
        ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
        (
            {
                "messages": [
                    messages[0],
                    {**messages[1], "tool_calls": [{**call, "function": {"name": "f", "arguments": "[1]"}}]},
                ]
            },
            "messages[1].tool_calls[0].function.arguments",
        ),
        ({"messages": [{**messages[0], "tool_calls": [call]}]}, "messages[0].tool_calls"),
        ({"messages": [{**messages[0], "tool_call_id": "c1"}]}, "messages[0].tool_call_id"),
    ]:
        with pytest.raises(OpenAIError) as error:
            parse_chat({"messages": messages, **body}, "m", LIMITS, fmt)
        assert error.value.status == 400 and error.value.param == param, body


def test_a_special_token_trigger_is_a_token_in_the_grammar_and_kept_in_the_text(tokenizer):
    """Mistral's [TOOL_CALLS] as its tokenizers have it, one special token (a byte-level BPE trained on a few
    lines here): referenced by id in the grammar, which takes the call, and decoded, not skipped."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>", "[TOOL_CALLS]"],
        show_progress=False,
    )
    hf.train_from_iterator(['{"name": "now", "arguments": {}}', "Once upon a time."] * 20, trainer)
    mistral = Tokenizer(hf, None, (hf.token_to_id("<|endoftext|>"),), None, None)
    fmt = ToolFormat.for_tokenizer(FORMATS["mistral"], mistral)
    assert fmt.trigger_token == hf.token_to_id("[TOOL_CALLS]")
    user = [{"role": "user", "content": "Hi"}]
    request = parse_chat({"messages": user, "tools": TOOLS, "tool_choice": "required"}, "m", LIMITS, fmt)
    assert request.params.skip_special_tokens is False
    text = '[TOOL_CALLS][{"name": "now", "arguments": {}}]'
    tokens = mistral.encode(text, add_special_tokens=False)
    assert tokens[0] == fmt.trigger_token
    for tool_choice, prefix in (("required", []), ("auto", mistral.encode("Once upon a time.", False))):
        body = {"messages": user, "tools": TOOLS, "tool_choice": tool_choice}
        params = parse_chat(body, "m", LIMITS, fmt).params
        matcher = structured.matcher(params, mistral, hf.get_vocab_size())
        assert matcher.try_consume_tokens(prefix + tokens) == len(prefix + tokens) and matcher.is_accepting()
    assert mistral.decode(tokens, skip_special_tokens=False) == text
    # the bundled tokenizer spells "<tool_call>" in plain pieces: a literal in the grammar
    assert ToolFormat.for_tokenizer(FORMATS["hermes"], tokenizer).trigger_token is None


def test_the_parser_flag_overrides_the_template(tokenizer):
    from minisarathi.server.chat_template import ChatTemplate
    from minisarathi.server.tool_calls import tool_format

    hermes = ChatTemplate("<tool_call>{{ messages }}", {})
    assert tool_format(hermes, None, tokenizer).format.name == "hermes"
    assert tool_format(hermes, "llama3_json", tokenizer).format.name == "llama3_json"
    assert tool_format(ChatTemplate("{{ messages }}", {}), None, tokenizer) is None
    assert tool_format(None, "mistral", tokenizer).format.name == "mistral"


def test_the_format_is_told_from_the_template():
    from pathlib import Path

    templates = Path(__file__).resolve().parents[1] / "golden" / "chat_templates"
    assert detect_format((templates / "tools.jinja").read_text()) == "hermes"
    assert detect_format((templates / "chatml.jinja").read_text()) is None
    assert detect_format("{{ '[TOOL_CALLS]' }}") == "mistral"
    assert detect_format('{"name": ..., "parameters": ...}<|eot_id|>') == "llama3_json"
