"""Text <-> token ids for the engine, and chat templates.

Owns: reading a model folder's tokenizer files (tokenizer.json, tokenizer_config.json,
chat_template.jinja, generation_config.json, config.json); encode and decode; the ids
that end generation; rendering a chat template into a prompt.

Hugging Face transformers is the reference: `encode` gives what
`AutoTokenizer.from_pretrained(path)(text)["input_ids"]` gives, and
`apply_chat_template` renders what `tokenizer.apply_chat_template(...)` renders; the
tests compare the two. Where transformers does something surprising we mirror it
and say so in a comment. One deliberate exception: for a few `tokenizer_class`
values (e.g. "GPT2Tokenizer", used by MiniMax) transformers 5 rebuilds the
pipeline from the vocabulary and drops tokenizer.json's own pre-tokenizer; we
keep tokenizer.json, the tokenizer the model was trained with.

Must never: import transformers or torch (the engine serves without them), download
anything, or keep per-request state (that lives in detokenizer.py).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from tokenizers import AddedToken
from tokenizers import Tokenizer as _Backend

from tinyengine.chat_template import (
    ChatTemplateError,
    Message,
    compile_template,
    read_chat_template,
    validate_messages,
)

# The named special tokens of a tokenizer_config.json, in transformers' order.
_SPECIAL_TOKEN_NAMES = ("bos", "eos", "unk", "sep", "pad", "cls", "mask")
# Files that mean "this folder has a tokenizer", even one we cannot read.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class Tokenizer:
    """A Hugging Face fast tokenizer plus what the engine needs around it.

    Build it with `Tokenizer.from_pretrained(model_dir)`.
    """

    def __init__(
        self,
        backend: _Backend,
        *,
        special_tokens: Mapping[str, str] | None = None,
        chat_template: str | Mapping[str, str] | None = None,
        generation_eos_token_ids: Sequence[int] = (),
        name_or_path: str = "",
    ) -> None:
        self._backend = backend
        # Named special tokens as strings ("bos_token" -> "<s>"); the chat template
        # sees them under these names.
        self.special_tokens_map: dict[str, str] = dict(special_tokens or {})
        self.chat_template = chat_template
        self.name_or_path = name_or_path

        self.bos_token: str | None = self.special_tokens_map.get("bos_token")
        self.eos_token: str | None = self.special_tokens_map.get("eos_token")
        self.bos_token_id: int | None = self._id_of(self.bos_token)
        tokenizer_eos = self._id_of(self.eos_token)

        # The primary eos is the tokenizer's; without one, the first id of the
        # generation config. The engine stops on the union, as vLLM does. (HF
        # generate stops on the generation config's ids only; the tokenizer's eos
        # is among them in every model we know.)
        ordered = ([tokenizer_eos] if tokenizer_eos is not None else []) + list(
            generation_eos_token_ids
        )
        self.eos_token_id: int | None = ordered[0] if ordered else None
        self.eos_token_ids: set[int] = set(ordered)

        # Exactly the ids that decode(..., skip_special_tokens=True) drops: the
        # detokenizer filters on this set and must agree with decode.
        self.all_special_ids: list[int] = sorted(
            i for i, tok in backend.get_added_tokens_decoder().items() if tok.special
        )

    # ------------------------------------------------------------------ loading

    @classmethod
    def from_pretrained(cls, path: str | Path) -> Tokenizer:
        """Load the tokenizer of a Hugging Face model folder (needs tokenizer.json)."""
        folder = Path(path)
        if not folder.is_dir():
            raise FileNotFoundError(f"Tokenizer folder {str(folder)!r} does not exist.")
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(
                f"{str(folder)!r} has no tokenizer.json. tinyengine reads only the fast "
                "tokenizer format. Write one with transformers: "
                "AutoTokenizer.from_pretrained(src).save_pretrained(folder); or send "
                "prompts as token ids."
            )
        backend = _Backend.from_file(str(tokenizer_file))
        config = _read_json(folder / "tokenizer_config.json")

        special_tokens = _register_config_tokens(backend, config)

        # `add_bos_token`/`add_eos_token` in tokenizer_config.json are not read:
        # transformers 5 drops them when a tokenizer.json exists, and the
        # post-processor inside tokenizer.json alone decides whether encode adds
        # BOS. (DeepSeek-V3's config says add_bos_token=true, yet HF adds no BOS;
        # its chat template writes it.)
        return cls(
            backend,
            special_tokens=special_tokens,
            chat_template=read_chat_template(folder, config),
            generation_eos_token_ids=_read_eos_ids(folder),
            name_or_path=str(folder),
        )

    # ------------------------------------------------------------------ ids <-> text

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer knows, added tokens included (HF's
        `len(tokenizer)`). A model's embedding table may be larger (padding)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most text one token can stand for: the longest vocabulary entry,
        in symbols (byte-level BPE spells each byte as one symbol, so this is
        never fewer than the characters the token decodes to)."""
        return max(map(len, self._backend.get_vocab(with_added_tokens=True)), default=1)

    @property
    def add_bos_token(self) -> bool:
        """Whether encode(text) starts with BOS (decided by tokenizer.json)."""
        ids = self._backend.encode("", add_special_tokens=True).ids
        return bool(ids) and ids[0] == self.bos_token_id

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, got {type(text).__name__}.")
        # encode_batch releases the GIL while it works (encode holds it), so a
        # long prompt tokenized on a worker thread does not stall the server's
        # event loop or the engine thread; one text gives the same ids.
        return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        # No clean_up_tokenization_spaces: transformers skips it for BPE models,
        # which covers every family tinyengine serves.
        return self._backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, token_ids: Sequence[int]) -> list[str]:
        """The raw vocabulary entries, e.g. 'Ġhello' or '▁hello' or '<0xE4>'."""
        return [self._piece(i) for i in token_ids]

    def convert_tokens_to_ids(self, tokens: Sequence[str]) -> list[int]:
        ids = [self._backend.token_to_id(t) for t in tokens]
        if None in ids:
            missing = [t for t, i in zip(tokens, ids, strict=True) if i is None]
            raise ValueError(f"Tokens not in the vocabulary: {missing!r}.")
        return ids  # type: ignore[return-value]

    def id_to_piece(self, token_id: int) -> str:
        """One token as display text (for logprobs): special tokens are kept, and a
        token holding part of a UTF-8 character shows as U+FFFD."""
        return self._backend.decode([token_id], skip_special_tokens=False)

    def _piece(self, token_id: int) -> str:
        piece = self._backend.id_to_token(token_id)
        if piece is None:
            raise ValueError(
                f"Token id {token_id} is outside the tokenizer's vocabulary "
                f"(0..{self.vocab_size - 1})."
            )
        return piece

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._backend.token_to_id(token)

    # ------------------------------------------------------------------ chat

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template)

    def apply_chat_template(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        documents: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str | list[int]:
        """Render `messages` with the model's chat template, as transformers does.

        `chat_template` may be a template string or the name of one of the model's
        named templates. Extra keyword arguments reach the template as variables
        (e.g. `enable_thinking=False`). With `tokenize=True` the prompt is encoded
        without adding special tokens: the template already wrote BOS if it wants one.
        """
        template = self._select_template(chat_template, tools)
        chat = validate_messages(messages)
        variables = {**self.special_tokens_map, **kwargs}  # kwargs win, as in HF
        try:
            prompt = compile_template(template).render(
                messages=chat,
                tools=tools,
                documents=documents,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except jinja2.TemplateError as e:
            # raise_exception() calls and missing fields both land here; either way
            # the messages do not fit this model's template.
            raise ChatTemplateError(
                f"The chat template of {self.name_or_path!r} rejected these messages: {e}"
            ) from e
        if tokenize:
            return self.encode(prompt, add_special_tokens=False)
        return prompt

    def _select_template(self, requested: str | None, tools: list | None) -> str:
        templates = self.chat_template
        if isinstance(templates, Mapping):
            if requested is not None and requested in templates:
                return templates[requested]
            if requested is not None:
                return requested
            if tools is not None and "tool_use" in templates:
                return templates["tool_use"]
            if "default" in templates:
                return templates["default"]
            raise ValueError(
                f"{self.name_or_path!r} has several chat templates and none is named "
                f"'default'; pass chat_template= one of {sorted(templates)}."
            )
        if requested is not None:
            return requested
        if not templates:
            raise ValueError(
                f"The tokenizer of {self.name_or_path!r} has no chat template (no "
                "chat_template in tokenizer_config.json and no chat_template.jinja), so "
                "chat messages cannot be turned into a prompt. Use the completions API "
                "with a plain prompt, or pass a template with chat_template=."
            )
        return templates


# ---------------------------------------------------------------------- loading helpers


def load_tokenizer_if_present(path: str | Path) -> Tokenizer | None:
    """The folder's tokenizer, or None when it has no tokenizer files at all (a
    model that is only ever given token ids). A folder that has some tokenizer
    files but no tokenizer.json is an error, not a silent None."""
    folder = Path(path)
    if not any((folder / name).exists() for name in _TOKENIZER_FILES):
        return None
    return Tokenizer.from_pretrained(folder)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e}); fix or remove it.") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} should hold a JSON object, not {type(data).__name__}.")
    return data


def _parse_added_token(value: Any, special: bool = True) -> AddedToken | None:
    """A token from tokenizer_config.json: a plain string, or an AddedToken dict
    ({"__type": "AddedToken", "content": ..., "lstrip": ...})."""
    if value is None:
        return None
    if isinstance(value, str):
        return AddedToken(value, special=special, normalized=False)
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return AddedToken(
            value["content"],
            single_word=bool(value.get("single_word", False)),
            lstrip=bool(value.get("lstrip", False)),
            rstrip=bool(value.get("rstrip", False)),
            normalized=bool(value.get("normalized", False)),
            special=special,
        )
    raise ValueError(f"Cannot read special token {value!r} from tokenizer_config.json.")


def _register_config_tokens(backend: _Backend, config: Mapping[str, Any]) -> dict[str, str]:
    """Add tokenizer_config.json's tokens to `backend` as transformers does, and
    return the named special tokens ("bos_token" -> "<s>", and v5's named extras
    such as "image_token"), which chat templates see as variables.

    transformers re-registers every special token of the config as a special added
    token, new to the vocab or not: that decides how text containing it splits and
    whether decode skips it. It also adds `added_tokens_decoder` entries missing
    from tokenizer.json (Qwen3.5 lists four that way).
    """
    known = {t.content for t in backend.get_added_tokens_decoder().values()}
    for _, entry in sorted(
        (config.get("added_tokens_decoder") or {}).items(), key=lambda kv: int(kv[0])
    ):
        token = _parse_added_token(entry, special=bool(entry.get("special", False)))
        if token is not None and token.content not in known:
            backend.add_tokens([token])

    named: dict[str, Any] = {f"{n}_token": config.get(f"{n}_token") for n in _SPECIAL_TOKEN_NAMES}
    unnamed: list[Any] = []
    for key in ("additional_special_tokens", "extra_special_tokens"):
        extra = config.get(key)
        if isinstance(extra, Mapping):
            named.update(extra)
        elif isinstance(extra, list):
            unnamed.extend(extra)
    special_tokens: dict[str, str] = {}
    for name, value in [*named.items(), *((None, v) for v in unnamed)]:
        token = _parse_added_token(value)
        if token is None:
            continue
        backend.add_special_tokens([token])
        if name is not None:
            special_tokens[name] = token.content
    return special_tokens


def _read_eos_ids(folder: Path) -> list[int]:
    """eos ids of generation_config.json, then config.json (each an int, a list or
    null), in order and without repeats."""
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        value = _read_json(folder / name).get("eos_token_id")
        for i in value if isinstance(value, list) else [value]:
            if isinstance(i, int) and i not in ids:
                ids.append(i)
    return ids


# ---------------------------------------------------------------------- chat helpers
