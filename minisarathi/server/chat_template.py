"""Chat templates: the model folder's Jinja2 template, rendered as transformers' apply_chat_template renders
it.

A template is code from the internet, so it runs in Jinja2's ImmutableSandboxedEnvironment (no access to
Python internals, no mutation of the messages), with the environment transformers sets up: trim_blocks,
lstrip_blocks, the loopcontrols extension, a `{% generation %}` block (transformers uses it to mark
assistant tokens; here it renders its body), a `tojson` filter that keeps non-ASCII text as is,
`raise_exception`, `strftime_now`, and the tokenizer's special tokens (`bos_token`, `eos_token`, ...) as
variables. The rendered text is tokenized without adding special tokens: the template writes its own.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from minisarathi.tokenizer import special_tokens, tokenizer_config


class ChatTemplateError(ValueError):
    """The messages cannot be rendered: the template raised (raise_exception) or broke a sandbox rule."""


class _GenerationBlock(jinja2.ext.Extension):
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson escapes HTML characters, which a prompt must not get.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format):
    return datetime.now().strftime(format)


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str]):
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"chat template: syntax error on line {e.lineno}: {e.message}") from None
        self.special_tokens = dict(special_tokens)

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        try:
            return self._template.render(
                messages=messages,
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self.special_tokens,
            )
        except jinja2.TemplateError as e:  # SecurityError included
            raise ChatTemplateError(str(e)) from None
        except (
            Exception
        ) as e:  # the template's own bug on these messages (a TypeError, a division by zero...)
            raise ChatTemplateError(
                f"the template failed on these messages: {type(e).__name__}: {e}"
            ) from None


def load_chat_template(model_dir: str | Path, override: str | Path | None = None) -> ChatTemplate | None:
    """The template of `override` (a file: serve's --chat-template), else the folder's chat_template.jinja,
    else tokenizer_config.json's `chat_template` (a string, or a list of named templates: the one named
    "default"; a GGUF file's `tokenizer.chat_template`); None if it has none."""
    model_dir = Path(model_dir)
    config = tokenizer_config(model_dir)  # a GGUF file's metadata gives its tokenizer.chat_template
    if override is not None:
        try:
            source = Path(override).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(
                f"--chat-template {override}: cannot be read ({getattr(e, 'strerror', None) or e})"
            ) from None
    elif (model_dir / "chat_template.jinja").is_file():
        source = (model_dir / "chat_template.jinja").read_text(encoding="utf-8")
    else:
        source = config.get("chat_template")
        if isinstance(source, list):
            source = next(
                (t.get("template") for t in source if isinstance(t, dict) and t.get("name") == "default"),
                None,
            )
    if not isinstance(source, str):
        return None
    return ChatTemplate(source, special_tokens(model_dir))
