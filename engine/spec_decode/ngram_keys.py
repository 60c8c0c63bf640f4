"""Match keys of the n-gram proposer: one id per token standing for every token of the same text
up to leading spaces and letter case (" The", "The", " the" and "the" share a key; so do a
word-internal "in" and the word " in").

Why: prompt lookup matches token ids, and a copied word often comes back spelled otherwise than
in its source: the first word of an answer has no leading space ("The" where the text had
" The"), a word moves to the start of a sentence or out of it (" children" against "
Children"). The proposer searches the keys only where the ids match nowhere (ngram.py), so an
exact match always wins and the keys only add drafts; those are still the exact tokens that
followed the match, verified as any draft. On bench/speculative.py's editing tasks (SmolLM2,
greedy, CPU simulation) the steps without a draft halve (K 4: 11.1% -> 5.7%), tokens a step
+2.5% (K 4) and +2.9% (K 6); on the H100, batch 8 K 4 covers 0.94 of sequence-steps instead of
0.886 (bench/NOTES.md, session 34).
"""

from __future__ import annotations

import logging

import numpy as np

logger = logging.getLogger(__name__)

MATCH_MODES = ("exact", "folded")


def fold(text: str) -> str:
    """A token's text as a key: without its leading spaces, in lower case ('' = no key)."""
    if "\ufffd" in text:  # part of a multi-byte character: no text of its own
        return ""
    return text.lstrip(" ").lower()


def folded_match_keys(tokenizer, vocab_size: int) -> np.ndarray:
    """[V] int32: each id's key, the smallest id with the same folded text; an id whose text folds
    to nothing (whitespace, a byte of a longer character), a special token, or one past the
    tokenizer's vocabulary (padded embedding rows) is its own key. V = max(vocab_size, the
    tokenizer's)."""
    num_tokens = int(tokenizer.vocab_size)
    size = max(int(vocab_size), num_tokens)
    keys = np.arange(size, dtype=np.int32)
    special = tokenizer.all_special_ids
    texts = tokenizer.backend.decode_batch([[i] for i in range(num_tokens)], skip_special_tokens=False)
    first: dict[str, int] = {}
    for token_id, text in enumerate(texts):
        folded = fold(text)
        if folded and token_id not in special:
            keys[token_id] = first.setdefault(folded, token_id)
    return keys


def match_keys(mode: str, tokenizer, vocab_size: int) -> np.ndarray | None:
    """The key table of an n-gram match mode: None for "exact" (or no tokenizer to fold with)."""
    if mode not in MATCH_MODES:
        raise ValueError(f"unknown speculative ngram_match {mode!r}; expected one of {MATCH_MODES}")
    if mode == "exact":
        return None
    if tokenizer is None:
        logger.info("speculative ngram_match %r without a tokenizer: matching ids only", mode)
        return None
    return folded_match_keys(tokenizer, vocab_size)
