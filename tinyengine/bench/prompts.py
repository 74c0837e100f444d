"""Random prompt token ids for the offline benchmarks.

Owns the rule for which ids a random prompt may hold (TokenPool): below both
the model's and the tokenizer's vocabulary and never a special or added
token, so a prompt is ordinary-text ids that every tokenizer detokenizes and
that carries no control token. Must never import torch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tinyengine.bench.common import BenchError


class TokenPool:
    """The token ids a random prompt may hold: below both the model's and the
    tokenizer's vocabulary, never a special token (any of tokenizer.json's
    added tokens -- control and placeholder tokens live there -- nor the
    config's bos / eos / pad ids), so prompts are ordinary-text ids that
    every tokenizer detokenizes."""

    def __init__(self, folder: str, model_vocab_size: int) -> None:
        import numpy as np

        from tinyengine.tokenizer import load_tokenizer_if_present

        high = model_vocab_size
        tokenizer = load_tokenizer_if_present(folder)
        if tokenizer is not None:
            high = min(high, tokenizer.vocab_size)
        banned = _special_ids(Path(folder))
        self.ids = np.setdiff1d(np.arange(high, dtype=np.int64), np.array(sorted(banned)))
        if len(self.ids) == 0:
            raise BenchError(f"no usable token ids below {high} in {folder}")

    def sample(self, rng: Any, n: int) -> list[int]:
        """n ids, uniform over the pool, from a numpy Generator."""
        return self.ids[rng.integers(0, len(self.ids), size=n)].tolist()


def _special_ids(folder: Path) -> set[int]:
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        data = _read_json(folder / name)
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = data.get(key)
            ids.update([value] if isinstance(value, int) else value or [])
    for token in _read_json(folder / "tokenizer.json").get("added_tokens", []):
        if isinstance(token.get("id"), int):
            ids.add(token["id"])
    return ids


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
