"""Structured outputs through both doors of one server: OpenAI's response_format (json_schema, json_object)
and vLLM's structured_outputs / guided_* fields through the official `openai` SDK and raw HTTP, the
msgpack `structured` field through the Client; refused constraints are a 400 (or invalid_params) naming the
field, and the server serves on."""

import json
import re

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("aiohttp")
pytest.importorskip("llguidance", reason="structured outputs need the structured extra (llguidance)")
jsonschema = pytest.importorskip("jsonschema", reason="the schema checks need jsonschema (the test extra)")
from test_http import API_KEY, launch, model_with_template, raw  # noqa: E402, F401

from minisarathi.client import Client  # noqa: E402
from minisarathi.llm import LLM  # noqa: E402
from minisarathi.sampling_params import SamplingParams  # noqa: E402
from minisarathi.server.protocol import INVALID_PARAMS, RPCError  # noqa: E402

pytestmark = pytest.mark.system

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Tell me about a person."}]


@pytest.fixture(scope="module")
def server(model_with_template):  # noqa: F811
    args = ("--http-port", "0", "--served-model-name", "stories260K", "--num-kv-blocks", "512")
    with launch(*args, model_dir=model_with_template) as s:
        s.client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{s.http_port}/v1", api_key=API_KEY, max_retries=0
        )
        yield s


def test_response_format_json_schema_validates_streamed_or_not(server):
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": SCHEMA, "strict": True},
    }
    for temperature in (0, 1.0):
        result = server.client.chat.completions.create(
            model="stories260K",
            messages=MESSAGES,
            max_tokens=100,
            temperature=temperature,
            n=4,
            seed=1,
            response_format=response_format,
        )
        for choice in result.choices:
            assert choice.finish_reason == "stop"
            jsonschema.validate(json.loads(choice.message.content), SCHEMA)
        chunks = server.client.chat.completions.create(
            model="stories260K",
            messages=MESSAGES,
            max_tokens=100,
            temperature=0,
            stream=True,
            response_format=response_format,
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        jsonschema.validate(json.loads(text), SCHEMA)


def test_completions_take_response_format_and_vllm_fields_as_offline(server):
    """The HTTP door's constraints are SamplingParams.structured: greedy text equals LLM.generate's."""
    prompt = "Once upon a time"
    forms = [
        ({"response_format": {"type": "json_object"}}, {"json_object": True}),
        ({"structured_outputs": {"regex": "[a-z]{2,6}-[0-9]{2}"}}, {"regex": "[a-z]{2,6}-[0-9]{2}"}),
        ({"guided_json": SCHEMA}, {"json": SCHEMA}),
        ({"guided_regex": "(yes|no)!"}, {"regex": "(yes|no)!"}),
        ({"guided_choice": ["cat", "dog"]}, {"choice": ["cat", "dog"]}),
        (
            {"guided_grammar": 'start: "a" NUM\nNUM: /[0-9]{3}/'},
            {"grammar": 'start: "a" NUM\nNUM: /[0-9]{3}/'},
        ),
    ]
    llm = LLM()
    for body, spec in forms:
        status, _, answer = raw(
            server,
            "POST",
            "/v1/completions",
            {"prompt": prompt, "max_tokens": 60, "temperature": 0, **body},
        )
        assert status == 200, answer
        want = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=60, structured=spec))[
            0
        ].outputs[0]
        assert (answer["choices"][0]["text"], answer["choices"][0]["finish_reason"]) == (
            want.text,
            want.finish_reason,
        )
    assert re.fullmatch(
        "(yes|no)!",
        llm.generate([prompt], SamplingParams(structured={"regex": "(yes|no)!"}))[0].outputs[0].text,
    )


@pytest.mark.parametrize(
    "body, param, message",
    [
        ({"response_format": {"type": "xml"}}, "response_format", "response_format must be"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema",
            "must be a JSON schema object",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "intger"}},
                }
            },
            "response_format.json_schema.schema",
            "response_format.json_schema.schema is refused by llguidance",
        ),
        ({"guided_regex": "[a-"}, "guided_regex", "guided_regex is refused by llguidance"),
        ({"guided_choice": []}, "guided_choice", "guided_choice must be a non-empty list"),
        (
            {"structured_outputs": {"xml": 1}},
            "structured_outputs",
            "structured_outputs must be a map with one key",
        ),
        ({"guided_regex": "a", "guided_json": {}}, "guided_regex", "cannot be combined with guided_json"),
        ({"guided_regex": "a", "min_tokens": 2}, "min_tokens", "min_tokens cannot be combined"),
    ],
)
def test_a_refused_constraint_is_a_400_naming_the_field(server, body, param, message):
    status, _, answer = raw(
        server, "POST", "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 8, **body}
    )
    assert status == 400, answer
    assert answer["error"]["param"] == param and message in answer["error"]["message"], answer


def test_a_grammar_refused_by_the_tokenizer_is_a_400_at_admission(server):
    status, _, answer = raw(
        server, "POST", "/v1/completions", {"prompt": "x", "guided_grammar": 'start: "a" <|nope|>'}
    )
    assert status == 400 and "unknown special token" in answer["error"]["message"], answer
    status, _, _ = raw(server, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert status == 200  # and the server serves on


def test_msgpack_structured_field(server):
    with Client("127.0.0.1", server.msgpack_port, api_key=API_KEY) as client:
        result = client.generate(
            "Once upon a time", max_tokens=100, temperature=0, structured={"json": SCHEMA}
        )
        assert result.finish_reason == "stop"
        jsonschema.validate(json.loads(result.text), SCHEMA)
        stream = client.generate_stream("Tom had", max_tokens=20, structured={"choice": ["cat", "dog"]})
        assert "".join(chunk.text for chunk in stream) in ("cat", "dog")
        short = client.generate("Once upon a time", max_tokens=3, temperature=0, structured={"json": SCHEMA})
        assert short.finish_reason == "length"
        for structured, message in [
            ({"json": {"type": "intger"}}, "structured.json is refused by llguidance"),
            ({"regex": 5}, "structured.regex must be a non-empty string"),
            ({"grammar": 'start: "a" <|nope|>'}, "structured is refused by llguidance"),
        ]:
            with pytest.raises(RPCError) as error:
                client.generate("x", structured=structured)
            assert error.value.code == INVALID_PARAMS and message in error.value.message
        assert client.generate("x", max_tokens=2).completion_tokens == 2
