"""Whether a model that ties its LM head to its input embedding
(`tie_word_embeddings`) should keep the tie for a given checkpoint.

Hugging Face transformers (5.x) keeps it only when the checkpoint does not
store the head on its own: a checkpoint that holds both tensors with
different values loads untied (transformers warns and uses each tensor), so
the logits come from the stored head. The loader follows it, since the
engine's outputs are checked against transformers'; the check reads both
tensors a block of rows at a time and only when both are stored, which a
tied checkpoint rarely does.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors import safe_open

logger = logging.getLogger("tinyengine.models")

# (head, embedding) checkpoint names: Hugging Face's, and DeepSeek's own.
_PAIRS = (("lm_head.weight", "model.embed_tokens.weight"), ("head.weight", "embed.weight"))
_ROWS_PER_BLOCK = 4096


def keeps_tie(folder: Path, weight_map: dict[str, str]) -> bool:
    """False when the checkpoint stores an LM head that differs from its
    embedding (shape or values); True otherwise."""
    for head, embed in _PAIRS:
        if head in weight_map and embed in weight_map:
            if _same(folder / weight_map[head], head, folder / weight_map[embed], embed):
                return True
            logger.warning(
                "config.json ties the LM head to the embedding (tie_word_embeddings), but the "
                "checkpoint stores %s with other values than %s; loading them untied, as "
                "transformers does", head, embed,
            )  # fmt: skip
            return False
    return True


def _same(head_file: Path, head: str, embed_file: Path, embed: str) -> bool:
    with safe_open(str(head_file), "pt") as h, safe_open(str(embed_file), "pt") as e:
        a, b = h.get_slice(head), e.get_slice(embed)
        shape = a.get_shape()
        if shape != b.get_shape() or a.get_dtype() != b.get_dtype():
            return False
        for start in range(0, shape[0] if shape else 0, _ROWS_PER_BLOCK):
            rows = slice(start, start + _ROWS_PER_BLOCK)
            if not torch.equal(a[rows], b[rows]):
                return False
    return True
