"""The limits a chat template renders under, on the template alone (tests/system/test_template_limits.py has
the server's worker process): loading runs none of it, and an output over max_chars stops early."""

import time

import pytest

pytest.importorskip("jinja2")

from minisarathi.server.chat_template import ChatTemplate, ChatTemplateError  # noqa: E402

SPECIAL = {"bos_token": "<s>", "eos_token": "</s>"}


def test_loading_a_template_runs_none_of_it():
    # Jinja folds constant expressions as it compiles: this one took seconds and 100 MB at load
    start = time.monotonic()
    template = ChatTemplate("{{ 'a' * 10**8 }}", SPECIAL)
    assert time.monotonic() - start < 0.5
    with pytest.raises(ChatTemplateError, match="the rendered prompt exceeds 1000 characters"):
        template.render([], max_chars=1000)


def test_an_output_over_max_chars_stops_where_it_passes():
    source = "{% for i in range(100000) %}{{ i }}{{ raise_exception('went on') if i > 200 }}{% endfor %}"
    template = ChatTemplate(source, SPECIAL)
    with pytest.raises(ChatTemplateError, match="the rendered prompt exceeds 100 characters"):
        template.render([], max_chars=100)
    with pytest.raises(ChatTemplateError, match="went on"):  # without the cap it would have gone on
        template.render([])
    assert ChatTemplate("{{ bos_token }}", SPECIAL).render([], max_chars=3) == "<s>"


def test_a_lone_surrogate_in_the_output_is_refused():
    with pytest.raises(ChatTemplateError, match="lone UTF-16 surrogate"):
        ChatTemplate("{{ '\\ud800' }}", SPECIAL).render([])
