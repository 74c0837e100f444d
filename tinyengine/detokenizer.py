"""Token ids -> streamed text, one token at a time, and stop strings.

Owns: per-request incremental decoding (`IncrementalDetokenizer`), finding a stop
string in freshly decoded text (`find_stop_string`), and how much text streaming
must hold back because it may be the start of a stop string
(`stop_string_holdback`).

Must never: emit a partial character (a U+FFFD that a later token would have
completed), re-decode the whole output each step, or decide when a request
finishes: it reports where a stop string is, the engine acts on it.

Invariant: the concatenation of every delta (`step` and `flush`) is exactly
`tokenizer.decode(output_ids, skip_special_tokens=...)`, and at any moment `.text`
is a prefix of that final string. One exception, which no streamer can honour:
a byte-fallback tokenizer (sentencepiece "<0xE4>" tokens) given bytes that are
not valid UTF-8. Its decoder then turns the *whole* run of byte tokens into
U+FFFD, retroactively, even bytes that were valid on their own; we keep
what was already streamed. Waiting for every byte run to end instead would stall
streaming of CJK text, which such tokenizers spell entirely in byte tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

from tinyengine.tokenizer import Tokenizer

# A character split across tokens decodes to this until its last byte arrives.
REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns one request's output tokens into text deltas.

    Decoding token i alone is wrong in two ways: a token may hold only some of a
    character's UTF-8 bytes, and tokenizers strip or rewrite a token's leading
    space ("▁" / "Ġ") depending on what precedes it. Re-decoding all output each
    step is right but O(n) per token. So (the technique of vLLM and TGI) we decode
    a small window and diff:

        ids:    ... | prefix_offset ........ read_offset ........ len(ids)
                      [ already emitted,   ][ not yet emitted         ]
                      [ kept as context    ]

    prefix_text = decode(ids[prefix_offset:read_offset]) and
    new_text    = decode(ids[prefix_offset:]); the delta is what new_text adds.
    The context makes the first new token decode as it does mid-sequence. Both
    offsets only move forward, to positions where the decoded text ended on a
    whole character, so the window holds the last emitted chunk plus the tokens
    still waiting: O(1) in the sequence length.

    Output is decoded on its own, not in the context of the prompt, so the text
    equals `tokenizer.decode(output_ids)` as in Hugging Face. (vLLM seeds the window
    with the prompt's last tokens instead; for sentencepiece tokenizers that keeps
    the space of a first "▁Paris", which decode(output_ids) drops.)
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int] | None = None,
        skip_special_tokens: bool = True,
    ) -> None:
        # prompt_token_ids: accepted so the call reads like vLLM's; see the class
        # docstring for why the prompt is deliberately not decoding context.
        del prompt_token_ids
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._skip_ids = frozenset(tokenizer.all_special_ids if skip_special_tokens else ())
        # Output ids that contribute text (skipped special tokens never enter, so
        # a window never starts with text that decode() would not show).
        self._ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""

    def step(self, token_id: int) -> str:
        """Add one generated token; return the text it completes ("" while a
        character is still partial or the token is a skipped special token)."""
        if token_id in self._skip_ids:
            return ""
        self._ids.append(token_id)
        prefix_text = self.tokenizer.decode(
            self._ids[self.prefix_offset : self.read_offset], skip_special_tokens=False
        )
        new_text = self.tokenizer.decode(self._ids[self.prefix_offset :], skip_special_tokens=False)
        # A trailing U+FFFD means the last token ended inside a character: wait for
        # the rest. (A genuine U+FFFD at the very end is released by flush().)
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""
        delta = new_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self._ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """Release text still held back; call once, when the request finishes.

        Only a trailing partial or invalid character can be held: it is emitted
        as decode() shows it (U+FFFD), so the invariant holds at the end.
        """
        if self.read_offset == len(self._ids):
            return ""
        prefix_text = self.tokenizer.decode(
            self._ids[self.prefix_offset : self.read_offset], skip_special_tokens=False
        )
        new_text = self.tokenizer.decode(self._ids[self.prefix_offset :], skip_special_tokens=False)
        delta = new_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset = len(self._ids)
        self.text += delta
        return delta

    @property
    def num_output_tokens(self) -> int:
        """Output tokens that produce text (skipped special tokens excluded)."""
        return len(self._ids)


def find_stop_string(text: str, stops: Sequence[str], num_new_chars: int) -> tuple[int, str] | None:
    """Find a stop string that the last `num_new_chars` characters of `text`
    completed; return (index where it starts in `text`, the stop string), or None.

    The caller cuts the output at that index (vLLM's default), or after the stop
    string with `include_stop_str_in_output`. Earlier text was searched when it
    was new, so only an occurrence that *ends* inside the new characters counts;
    it may start before them (a stop split across tokens).

    Several matches: the one that ends first wins, and among those the longest.
    That is the one a character-by-character reader would have met first, so the
    answer does not depend on how the text happened to be split into tokens.
    (vLLM instead takes the first stop in list order that appears.)
    """
    if num_new_chars <= 0:
        return None
    first_new = len(text) - num_new_chars
    best: tuple[int, int, str] | None = None  # (end, -len, stop)
    for stop in stops:
        if not stop:
            continue  # an empty stop would match everywhere; SamplingParams rejects it
        # The first occurrence whose end is past `first_new`.
        start = text.find(stop, max(0, first_new - len(stop) + 1))
        if start < 0:
            continue
        candidate = (start + len(stop), -len(stop), stop)
        if best is None or candidate < best:
            best = candidate
    if best is None:
        return None
    end, _, stop = best
    return end - len(stop), stop


def stop_string_holdback(text: str, stops: Sequence[str]) -> int:
    """How many trailing characters of `text` must not be streamed yet, because
    the next tokens could complete them into a stop string (which is then cut).

    The answer is the length of the longest suffix of `text` that is a proper
    prefix of some stop. vLLM holds back len(longest stop) - 1 characters always;
    this is never more than that and streams "Hello" at once when the stop is
    "\\n\\n". With `include_stop_str_in_output` nothing needs holding back: the
    caller passes no stops (or ignores this).
    """
    if not text:
        return 0
    last = text[-1]
    held = 0
    for stop in stops:
        # Only suffixes longer than what is already held can raise the answer,
        # and only prefixes stop[:k] ending in text's last character can be
        # one: rfind jumps between those k (it runs every step, on every stop).
        k = min(len(stop) - 1, len(text))
        while k > held:
            k = stop.rfind(last, 0, k) + 1
            if k > held and text.endswith(stop[:k]):
                held = k
                break
            k -= 1
    return held
