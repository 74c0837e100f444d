"""DeepSeek-V4's chat format (tinyengine/tools/v4_chat_template.py) rendered
by the engine's template sandbox: the strings DeepSeek's V4 encoding
produces for system / user / assistant chats, in chat mode (the default)
and in thinking mode (`thinking=True`)."""

from __future__ import annotations

import pytest

from tinyengine.chat_template import compile_template, validate_messages
from tinyengine.tools.v4_chat_template import V4_CHAT_TEMPLATE

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
U, A = "<｜User｜>", "<｜Assistant｜>"


def render(messages, add_generation_prompt=True, **kwargs) -> str:
    template = compile_template(V4_CHAT_TEMPLATE)
    return template.render(
        messages=validate_messages(messages), bos_token=BOS, eos_token=EOS,
        add_generation_prompt=add_generation_prompt, **kwargs,
    )  # fmt: skip


CHAT = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "hello"},
    {"role": "assistant", "content": "Hello! I am DeepSeek.", "reasoning_content": "greet"},
    {"role": "user", "content": "1+1=?"},
]


def test_chat_mode_opens_every_answer_with_an_empty_thought():
    assert render(CHAT) == (
        f"{BOS}You are a helpful assistant.{U}hello{A}</think>Hello! I am DeepSeek.{EOS}"
        f"{U}1+1=?{A}</think>"
    )


def test_thinking_mode_opens_a_thought_after_the_last_user_turn_only():
    # Earlier answers keep the empty-thought opening and lose their reasoning.
    assert render(CHAT, thinking=True) == (
        f"{BOS}You are a helpful assistant.{U}hello{A}</think>Hello! I am DeepSeek.{EOS}"
        f"{U}1+1=?{A}<think>"
    )


def test_a_prefilled_answer_after_the_last_user_turn_keeps_its_reasoning():
    chat = [*CHAT, {"role": "assistant", "content": "2", "reasoning_content": "add"}]
    assert render(chat, add_generation_prompt=False, thinking=True).endswith(
        f"{U}1+1=?{A}<think>add</think>2{EOS}"
    )
    assert render(chat, add_generation_prompt=False).endswith(f"{U}1+1=?{A}</think>2{EOS}")


def test_without_a_generation_prompt_and_with_content_parts():
    chat = [{"role": "user", "content": [{"type": "text", "text": "a"},
                                         {"type": "text", "text": "b"}]}]  # fmt: skip
    assert render(chat, add_generation_prompt=False) == f"{BOS}{U}ab"
    assert render(chat) == f"{BOS}{U}ab{A}</think>"


@pytest.mark.parametrize("thinking", [False, True])
def test_the_tiny_preset_ships_the_template(thinking, tmp_path):
    """The preset folder carries the template, and the real V4 tokenizer
    keeps its markers whole (<think> is id 128821, </think> 128822)."""
    from tinyengine.tokenizer import load_tokenizer_if_present
    from tinyengine.tools.make_v4 import write_v4

    folder = write_v4(tmp_path / "v4", "deepseek-v4-tiny", progress=False)
    tok = load_tokenizer_if_present(folder)
    chat = [{"role": "user", "content": "hi"}]
    prompt = tok.apply_chat_template(chat, add_generation_prompt=True, thinking=thinking)
    assert prompt == f"{BOS}{U}hi{A}{'<think>' if thinking else '</think>'}"
    ids = tok.apply_chat_template(chat, tokenize=True, add_generation_prompt=True,
                                  thinking=thinking)  # fmt: skip
    assert ids[0] == 0 and ids[-2:] == [128804, 128821 if thinking else 128822]
