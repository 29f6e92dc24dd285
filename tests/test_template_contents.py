"""The proof that a chat template inserts contents verbatim, and the render it licenses.

Expected verdicts are read off each template by hand; rendered texts are compared with jinja's
own render of the template (transformers' ``apply_chat_template``)."""

from __future__ import annotations

import dataclasses

import pytest
from transformers import AutoTokenizer
from transformers.utils.chat_template_utils import _compile_jinja_template

from mimo_data.preprocess.chat_tokens import TextEncoder
from mimo_data.preprocess.config import PreprocessConfig
from mimo_data.preprocess.template_contents import contents_inserted_verbatim

from conftest import REPO

TOKENIZER = str(REPO / "assets" / "tokenizer" / "smollm2")
LOOP = "{% for m in messages %}"
END = "{% endfor %}"

VERBATIM = {
    "smollm2": open(REPO / "assets" / "tokenizer" / "smollm2" / "chat_template.jinja").read()
    if (REPO / "assets" / "tokenizer" / "smollm2" / "chat_template.jinja").exists() else None,
    "system first": "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\n' }}"
                    "{% endif %}{% for m in messages[1:] %}{{ '<' ~ m.role ~ '>' ~ m.content }}"
                    + END,
    "string test": LOOP + "{% if m.content is string %}{{ m.content }}{% endif %}" + END,
    "length": LOOP + "{% if loop.last and messages|length > 2 %}!{% endif %}{{ m.content }}" + END,
    "either branch": LOOP + "{{ m.content if m.role == 'user' else '>' + m.content }}" + END,
}
NOT_VERBATIM = {
    "trim filter": LOOP + "{{ m['content'] | trim }}" + END,
    "condition on content": LOOP + "{% if m.content %}{{ m.content }}{% endif %}" + END,
    "contains test": LOOP + "{% if '<think>' in m.content %}x{% endif %}{{ m.content }}" + END,
    "method": LOOP + "{{ m.content.split('</think>')[-1] }}" + END,
    "slice": LOOP + "{{ m.content[1:] }}" + END,
    "comparison in output": LOOP + "{{ 'a' if m.content == 'x' else 'b' }}" + END,
    "tojson of all": "{{ messages | tojson }}",
    "tojson of one": LOOP + "{{ m | tojson }}" + END,
    "set from content": LOOP + "{% set c = m.content %}{{ c }}" + END,
    "captured by set block": LOOP + "{% set c %}{{ m.content }}{% endset %}{{ c | trim }}" + END,
    "filter block": LOOP + "{% filter upper %}{{ m.content }}{% endfilter %}" + END,
    "macro output": "{% macro r() %}{{ messages[0].content }}{% endmacro %}{{ r() | trim }}",
    "previous item": LOOP + "{% if loop.previtem %}{{ loop.previtem.content | trim }}{% endif %}"
                     + END,
    "namespace": "{% set ns = namespace(x=messages) %}{% for m in ns.x %}{{ m.content | trim }}"
                 + END,
    "namespace attribute": "{% set ns = namespace(x='') %}" + LOOP + "{% set ns.x = m %}" + END
                           + "{{ ns.x.content | trim }}",
    "alias": "{% set msgs = messages %}{% for m in msgs %}{{ m.content | trim }}" + END,
    "filtered loop": "{% for m in messages | reverse %}{{ m.content | trim }}" + END,
    "other key": LOOP + "{{ m.name }}{{ m.content }}" + END,
    "get method": LOOP + "{{ m.get('content') }}" + END,
    "loop object": LOOP + "{{ loop | string }}" + END,
    # Found by review: ways around earlier versions of the proof.
    "block through self": "{% if false %}{% block b %}" + LOOP + "{{ m.content }}" + END
                          + "{% endblock %}{% endif %}{{ self.b() | replace('x', 'Y') }}",
    "scoped autoescape": "{% autoescape true %}" + LOOP + "{{ m.content }}" + END
                         + "{% endautoescape %}",
    "markup joined by +": LOOP + "{{ '' | e + m.content }}" + END,
    "computed key": LOOP + "{{ m['con' ~ 'tent'] | length }}{{ m.content }}" + END,
    "index from a content": "{{ messages[(messages[0].content == 'x') | int].role }}",
    "arguments to an allowed test": "{% set j = joiner('J') %}" + LOOP
                                    + "{% if m.content is defined(**({} if 'x' in m.content "
                                      "and j() == '' else {})) %}{% endif %}" + END + "{{ j() }}",
    "loop over a message": LOOP + "{% for k in m %}{{ k }}{% endfor %}{{ m.content }}" + END,
    "loop rebound": "{% set loop = messages %}{{ loop.count({'role': 'user', 'content': 'x'}) }}"
                    + LOOP + "{{ m.content }}" + END,
    "date of the render": "{{ strftime_now('%d %b %Y') }}" + LOOP + "{{ m.content }}" + END,
}


@pytest.fixture(scope="module")
def environment():
    return _compile_jinja_template("").environment


@pytest.mark.parametrize("name", sorted(VERBATIM))
def test_templates_that_output_contents_as_they_are_are_proven(environment, name):
    assert VERBATIM[name] is not None
    assert contents_inserted_verbatim(environment, VERBATIM[name])


@pytest.mark.parametrize("name", sorted(NOT_VERBATIM))
def test_templates_that_touch_contents_are_not(environment, name):
    assert not contents_inserted_verbatim(environment, NOT_VERBATIM[name])


def test_autoescaping_environment_is_not(environment):
    escaping = environment.overlay(autoescape=True)
    assert not contents_inserted_verbatim(escaping, VERBATIM["smollm2"])


# Contents a render could treat specially: jinja syntax, the skeleton's placeholder code
# points, surrounding whitespace, quotes, markers, the template's own special tokens.
CONTENTS = ["{{ messages }}{% if x %}", "\ue0000\ue001", "  padded \n", "\"quoted\" \\ 'x'",
            "<image> and <audio>", "<|im_end|> early", "", "é漢字🙂"]


@pytest.mark.parametrize("template", ["smollm2", "system first", "either branch"])
def test_proven_templates_render_as_jinja_does_without_jinja(template):
    base = PreprocessConfig.from_yaml(str(REPO / "configs" / "preprocess.yaml"))
    source = VERBATIM[template].replace("'<' ~ m.role ~ '>'",
                                        "'<|im_start|>' ~ m.role ~ '\n'").replace(
        "m.content }}", "m.content + '<|im_end|>' }}")
    config = dataclasses.replace(base, tokenizer=TOKENIZER, chat_template=source)
    encoder = TextEncoder(config)
    assert encoder.contents_verbatim
    reference = AutoTokenizer.from_pretrained(TOKENIZER)
    for shift in range(len(CONTENTS)):
        contents = CONTENTS[shift:] + CONTENTS[:shift]
        messages = [{"role": "system", "content": contents[0]}] + [
            {"role": ("user", "assistant")[i % 2], "content": c}
            for i, c in enumerate(contents[1:5])]
        for conversation in (messages, messages[1:]):
            expected = reference.apply_chat_template(conversation, chat_template=source,
                                                     tokenize=False)
            assert encoder.render(conversation)[0] == expected, conversation
