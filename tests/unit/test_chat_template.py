"""Chat templates render and tokenize exactly as transformers' apply_chat_template (committed goldens made by
tests/golden/make_chat_goldens.py), inside a sandbox a template cannot escape."""

import asyncio
import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("jinja2")

from minisarathi.paths import default_model_dir
from minisarathi.server.chat_template import (
    ChatTemplate,
    ChatTemplateError,
    TemplateWorker,
    load_chat_template,
)
from minisarathi.tokenizer import Tokenizer

GOLDEN_DIR = Path(__file__).resolve().parents[1] / "golden" / "chat_templates"
GOLDENS = json.loads((GOLDEN_DIR / "goldens.json").read_text(encoding="utf-8"))
SPECIAL = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}


@pytest.mark.parametrize(
    "golden",
    GOLDENS,
    ids=lambda g: (
        f"{g['template']}-{len(g['messages'])}-{g['add_generation_prompt']}-{g['chat_template_kwargs']}"
        f"{'-tools' if 'tools' in g else ''}"
    ),
)
def test_render_and_tokens_match_transformers(golden):
    template = ChatTemplate((GOLDEN_DIR / golden["template"]).read_text(encoding="utf-8"), SPECIAL)
    text = template.render(
        golden["messages"],
        golden["add_generation_prompt"],
        kwargs=golden["chat_template_kwargs"],
        tools=golden.get("tools"),
    )
    assert text == golden["text"]
    tokenizer = Tokenizer.from_pretrained(default_model_dir())
    assert tokenizer.encode(text, add_special_tokens=False) == golden["token_ids"]


def test_both_styles_are_covered_and_bos_is_not_doubled():
    assert {g["template"] for g in GOLDENS} == {
        "chatml.jinja",
        "llama3.jinja",
        "thinking.jinja",
        "tools.jinja",
    }
    assert any("tools" in g and any(m["role"] == "tool" for m in g["messages"]) for g in GOLDENS)
    tokenizer = Tokenizer.from_pretrained(default_model_dir())
    for golden in GOLDENS:
        if golden["template"] == "llama3.jinja":  # the template writes {{ bos_token }} itself
            assert golden["token_ids"].count(tokenizer.bos_token_id) == 1 == golden["token_ids"][:1].count(1)


@pytest.mark.parametrize(
    "source",
    [
        "{{ messages.__class__.__mro__[1].__subclasses__() }}",
        "{{ ''.__class__.__base__.__subclasses__() }}",
        "{{ raise_exception.__globals__.os }}",
        "{% set x = messages.append(1) %}",  # the immutable sandbox: no mutation
        "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    ],
)
def test_a_template_reaching_python_internals_fails_in_the_sandbox(source):
    with pytest.raises(ChatTemplateError):
        ChatTemplate(source, SPECIAL).render([{"role": "user", "content": "hi"}])


def test_raise_exception_and_syntax_errors_are_clear():
    llama3 = ChatTemplate((GOLDEN_DIR / "llama3.jinja").read_text(encoding="utf-8"), SPECIAL)
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        llama3.render([{"role": "assistant", "content": "x"}])
    with pytest.raises(ValueError, match="syntax error on line 1"):
        ChatTemplate("{% for %}", SPECIAL)


def test_load_from_folder(tmp_path):
    assert load_chat_template(default_model_dir()) is None  # the bundled model has none
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": {"content": "<s>"},
                "eos_token": "</s>",
                "chat_template": [
                    {"name": "default", "template": "{{ bos_token }}{{ messages[0].content }}"},
                    {"name": "tool_use", "template": "no"},
                ],
            }
        )
    )
    assert load_chat_template(tmp_path).render([{"role": "user", "content": "hi"}]) == "<s>hi"
    (tmp_path / "chat_template.jinja").write_text("{{ eos_token }}")  # the file wins, as in transformers
    assert load_chat_template(tmp_path).render([]) == "</s>"
    override = tmp_path / "other.jinja"
    override.write_text("X")
    assert load_chat_template(tmp_path, override).render([]) == "X"


def test_special_tokens_only_in_special_tokens_map(tmp_path):
    # many model folders name BOS/EOS only in special_tokens_map.json; transformers merges both files
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}"})
    )
    (tmp_path / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": {"content": "<s>", "lstrip": False}, "eos_token": "</s>"})
    )
    assert load_chat_template(tmp_path).render([{"role": "user", "content": "hi"}]) == "<s>hi</s>"
    shutil.copy(default_model_dir() / "tokenizer.json", tmp_path)
    tokenizer = Tokenizer.from_pretrained(tmp_path)
    assert (tokenizer.bos_token_id, tokenizer.eos_token_ids) == (1, (2,))


@pytest.mark.parametrize("source", ["{{ messages[0].content + 1 }}", "{{ 1 // (messages | length - 1) }}"])
def test_a_template_failing_in_python_is_a_template_error(source):
    with pytest.raises(ChatTemplateError, match="the template failed on these messages: "):
        ChatTemplate(source, SPECIAL).render([{"role": "user", "content": "hi"}])


def test_the_worker_renders_with_the_requests_chat_template_kwargs():
    template = ChatTemplate((GOLDEN_DIR / "thinking.jinja").read_text(encoding="utf-8"), SPECIAL)
    messages = [{"role": "user", "content": "hi"}]

    async def render(kwargs):
        worker = TemplateWorker(template, timeout_s=10.0, max_chars=10_000)
        try:
            return await worker.render(messages, True, kwargs)
        finally:
            await worker.close()

    assert asyncio.run(render({"enable_thinking": False})) == template.render(
        messages, True, kwargs={"enable_thinking": False}
    )
    assert asyncio.run(render({"enable_thinking": False})).endswith("<think>\n\n</think>\n\n")
    assert asyncio.run(render(None)).endswith("<|im_start|>assistant\n")  # the kwargs made the difference
