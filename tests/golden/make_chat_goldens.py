"""Regenerate tests/golden/chat_templates/goldens.json with Hugging Face transformers (no torch needed):

    pip install transformers && python tests/golden/make_chat_goldens.py

For each test template (a ChatML-style, a Llama-3-style, a Qwen3-style thinking one and a Qwen-style one
with tools, written for these tests) and each conversation, it stores what `apply_chat_template` renders,
with and without add_generation_prompt (and, for a template that reads enable_thinking, with each
chat_template_kwargs of KWARGS; for one that reads tools, the TOOL_CONVERSATIONS with TOOLS), and the
token ids of `apply_chat_template(..., tokenize=True)` over the bundled model's tokenizer. Last made with
transformers 5.24.0 (/work/venv-golden). The chat endpoint must render and tokenize exactly the same
(tests/unit/test_chat_template.py).
"""

import json
from pathlib import Path

from transformers import PreTrainedTokenizerFast

HERE = Path(__file__).resolve().parent / "chat_templates"
MODEL = Path(__file__).resolve().parents[2] / "models" / "stories260K"

CONVERSATIONS = [
    [{"role": "user", "content": "Tell me a story about a cat."}],
    [
        {"role": "system", "content": "  Be brief.  "},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Once upon a time, there was a dog."},
        {"role": "user", "content": 'Another one, with "quotes" and ünïcödé & <tags>!', "name": "Tom"},
    ],
    [{"role": "user", "content": "Line one\nline two\n\n  indented"}],
    [
        {"role": "user", "content": "2 + 2?"},
        {"role": "assistant", "content": "<think>\nSmall sums.\n</think>\n\n4"},
        {"role": "user", "content": "And 3 + 3?"},
    ],
]
KWARGS = [{}, {"enable_thinking": False}, {"enable_thinking": True}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "now", "description": 'The time, with "quotes" & ünïcödé'}},
]
# assistant tool_calls as transformers' templates read them: arguments a JSON object
TOOL_CONVERSATIONS = [
    [{"role": "user", "content": "Weather in Paris?"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and the time?"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                },
                {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": {}}},
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 22 °C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "noon"},
        {"role": "assistant", "content": "Sunny, at noon."},
        {"role": "user", "content": "Thanks"},
    ],
    [
        {"role": "user", "content": "Time?"},
        {
            "role": "assistant",
            "tool_calls": [{"id": "c", "type": "function", "function": {"name": "now", "arguments": {}}}],
        },
        {"role": "tool", "content": "noon"},
    ],
]


def main():
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=str(MODEL / "tokenizer.json"), bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    goldens = []
    for template_file in sorted(HERE.glob("*.jinja")):
        template = template_file.read_text(encoding="utf-8")
        cases = [(c, None) for c in CONVERSATIONS]
        if "tools" in template:
            cases += [(c, TOOLS) for c in TOOL_CONVERSATIONS]
        for conversation, tools in cases:
            for add_generation_prompt in (True, False):
                for extra in KWARGS if "enable_thinking" in template else KWARGS[:1]:
                    kwargs = dict(
                        chat_template=template,
                        add_generation_prompt=add_generation_prompt,
                        tools=tools,
                        **extra,
                    )
                    text = tokenizer.apply_chat_template(conversation, tokenize=False, **kwargs)
                    ids = tokenizer.apply_chat_template(
                        conversation, tokenize=True, return_dict=False, **kwargs
                    )
                    goldens.append(
                        {
                            "template": template_file.name,
                            "messages": conversation,
                            "add_generation_prompt": add_generation_prompt,
                            "chat_template_kwargs": extra,
                            **({"tools": tools} if tools else {}),
                            "text": text,
                            "token_ids": list(ids),
                        }
                    )
    (HERE / "goldens.json").write_text(
        json.dumps(goldens, indent=1, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    print(f"wrote {len(goldens)} goldens")


if __name__ == "__main__":
    main()
