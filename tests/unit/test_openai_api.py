"""The OpenAI request parser on plain dicts: what foreign clients send that changes nothing is taken, what
would change the output is refused naming the field."""

import pytest

from minisarathi.server.openai_api import DoorLimits, OpenAIError, parse_chat

LIMITS = DoorLimits(max_prompt_tokens=512, max_tokens=64, max_n=4, vocab_size=512)
USER = {"role": "user", "content": "Hi"}


def chat(**body):
    request = parse_chat({"messages": [USER], **body}, "m", LIMITS)
    return request, request.messages


def refused(**body) -> str:
    with pytest.raises(OpenAIError) as error:
        chat(**body)
    assert error.value.status == 400
    return error.value.param


def test_harmless_fields_of_foreign_clients_are_taken():
    chat(store=False, metadata={"user": "x"}, service_tier="auto")
    chat(store=None, metadata=None, service_tier=None)
    # an assistant message echoed back from an earlier answer, as the SDKs serialize it
    echoed = {
        "role": "assistant",
        "content": "Hello",
        "refusal": None,
        "tool_calls": [],
        "function_call": None,
        "audio": None,
        "annotations": [],
    }
    _, messages = chat(messages=[USER, echoed, USER])
    assert messages[1] == {"role": "assistant", "content": "Hello"}


def test_fields_that_would_change_the_output_are_refused():
    assert refused(store=True) == "store"
    assert refused(service_tier="flex") == "service_tier"
    assert refused(metadata={"n": 1}) == "metadata"
    for key, value in [
        ("tool_calls", [{"id": "1", "type": "function"}]),
        ("refusal", "no"),
        ("function_call", {"name": "f"}),
        ("audio", {"id": "a"}),
        ("annotations", [{"x": 1}]),
    ]:
        assert refused(messages=[{**USER, key: value}]) == f"messages[0].{key}"


def test_chat_template_kwargs_are_taken_as_plain_json():
    kwargs = {"enable_thinking": False, "level": 2, "names": ["a", {"b": None}], "t": 0.5}
    assert chat(chat_template_kwargs=kwargs)[0].chat_template_kwargs == kwargs
    assert chat(chat_template_kwargs=None)[0].chat_template_kwargs is None
    assert chat()[0].chat_template_kwargs is None


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ([1], "must be an object or null"),
        ({f"k{i}": 1 for i in range(17)}, "at most 16 keys"),
        ({"not a name": 1}, "must be a variable name"),
        ({"messages": []}, "must be a variable name other than"),
        ({"add_generation_prompt": False}, "must be a variable name other than"),
        ({"x": float("nan")}, "values must be plain JSON"),
        ({"x": [[[[1]]]]}, "nested at most 4 deep"),
        ({"x": "y" * 5000}, "at most 4096 characters"),
    ],
)
def test_chat_template_kwargs_refused_with_a_clear_400(kwargs, message):
    with pytest.raises(OpenAIError, match=message) as e:
        chat(chat_template_kwargs=kwargs)
    assert e.value.status == 400 and e.value.param == "chat_template_kwargs"
