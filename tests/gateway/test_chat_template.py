"""The chat template renders like transformers' apply_chat_template, with jinja2 alone."""

import json

import pytest

from gateway.chat_template import ChatTemplate
from pdmesh.errors import InvalidRequest

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello world"}]


def _model_dir(tmp_path, **config):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


def test_the_tiny_models_template_renders_exactly(tiny_llama_dir):
    template = ChatTemplate.from_model_dir(tiny_llama_dir)
    assert template.render(MESSAGES) == "<s>system: Be brief.\n<s>user: Hello world\nassistant:"
    assert template.render(MESSAGES, add_generation_prompt=False) == "<s>system: Be brief.\n<s>user: Hello world\n"


def test_text_parts_are_joined_with_newlines(tiny_llama_dir):
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]
    rendered = ChatTemplate.from_model_dir(tiny_llama_dir).render([{"role": "user", "content": parts}])
    assert rendered == "<s>user: Hello\nworld\nassistant:"


def test_a_non_text_part_is_rejected(tiny_llama_dir):
    parts = [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]
    with pytest.raises(InvalidRequest, match="unsupported message content part 'image_url'"):
        ChatTemplate.from_model_dir(tiny_llama_dir).render([{"role": "user", "content": parts}])


def test_no_template_is_an_invalid_request_at_render_time(tmp_path):
    template = ChatTemplate.from_model_dir(_model_dir(tmp_path, bos_token="<s>"))
    with pytest.raises(InvalidRequest, match="^the model has no chat template$"):
        template.render(MESSAGES)


def test_raise_exception_in_the_template_is_an_invalid_request(tmp_path):
    source = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be user') }}{% endif %}ok"
    template = ChatTemplate.from_model_dir(_model_dir(tmp_path, chat_template=source))
    assert template.render([{"role": "user", "content": "hi"}]) == "ok"
    with pytest.raises(InvalidRequest, match="^first message must be user$"):
        template.render(MESSAGES)


def test_special_tokens_as_dicts_and_the_default_of_named_templates(tmp_path):
    named = [{"name": "tool_use", "template": "tools"},
             {"name": "default", "template": "{{ bos_token }}{{ messages[0]['content'] }}{{ eos_token }}"}]
    template = ChatTemplate.from_model_dir(_model_dir(
        tmp_path, chat_template=named, bos_token={"content": "<bos>", "lstrip": False}, eos_token="<eos>"))
    assert template.render([{"role": "user", "content": "hi"}]) == "<bos>hi<eos>"


def test_trim_blocks_and_lstrip_blocks_are_on(tmp_path):
    source = ("{% for m in messages %}\n    {% if m['role'] == 'user' %}\n[{{ m['content'] }}]\n"
              "    {% endif %}\n{% endfor %}")
    template = ChatTemplate.from_model_dir(_model_dir(tmp_path, chat_template=source))
    assert template.render(MESSAGES) == "[Hello world]\n"


def test_a_template_error_is_an_invalid_request(tmp_path):
    template = ChatTemplate.from_model_dir(_model_dir(tmp_path, chat_template="{{ messages[0]['content'].x.y }}"))
    with pytest.raises(InvalidRequest, match="the chat template failed"):
        template.render(MESSAGES)
