"""Compiles a request's StructuredOutput against the model's tokenizer with xgrammar, once per
grammar: an LRU cache keyed by (kind, text, strict) keeps the compiled grammars.

xgrammar (not llguidance): on SmolLM2's 49,152-token vocabulary on the 2-core CPU machine its
per-token mask is ~3 us median / ~13-25 us mean against llguidance's ~70 us / ~550 us (whose
fresh matchers rebuild their lexer: p99 ~9 ms), for a ~50-100 ms compile per new schema that the
cache pays once (bench/grammar_engines.py, bench/NOTES.md "Structured outputs"). It is imported
on the first structured request: it imports transformers (~3 s), which other requests never need.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from pagedinfer.engine.errors import InvalidRequestError
from pagedinfer.engine.structured.spec import GrammarKind, StructuredOutput

DEFAULT_CACHE_SIZE = 256
_SOURCE_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")
_LABELS = {
    GrammarKind.JSON_SCHEMA: "JSON schema",
    GrammarKind.JSON_OBJECT: "JSON object",
    GrammarKind.REGEX: "regex",
    GrammarKind.CHOICE: "choice",
    GrammarKind.GRAMMAR: "grammar",
}


class GrammarCompiler:
    """Tokenizer-bound compiler + LRU cache. Thread-safe (requests are validated on the engine's
    caller thread, matchers are made on the step thread)."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        cache_size: int = DEFAULT_CACHE_SIZE,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the model's (its logits' width; may exceed the tokenizer's)
        self.stop_token_ids = list(stop_token_ids)
        self.cache_size = cache_size
        self._cache: OrderedDict[tuple, Any] = OrderedDict()
        self._lock = threading.Lock()
        self._compiler = None  # xgrammar.GrammarCompiler, built on first use
        self.num_compiled = 0  # cache misses (tests and stats)

    def compile(self, spec: StructuredOutput):
        """The xgrammar CompiledGrammar of `spec`; InvalidRequestError naming the field when the
        schema, regex or grammar is invalid."""
        key = spec.cache_key
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                return compiled
            compiled = self._compile(spec)
            self.num_compiled += 1
            self._cache[key] = compiled
            if len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return compiled

    def _compile(self, spec: StructuredOutput):
        compiler = self._xgrammar_compiler()
        try:
            if spec.kind is GrammarKind.JSON_SCHEMA:
                return compiler.compile_json_schema(spec.text, any_whitespace=False, strict_mode=spec.strict)
            if spec.kind is GrammarKind.JSON_OBJECT:
                return compiler.compile_json_schema(
                    '{"type": "object"}', any_whitespace=False, strict_mode=False
                )
            if spec.kind is GrammarKind.REGEX:
                return compiler.compile_regex(spec.text)
            if spec.kind is GrammarKind.CHOICE:
                choices = json.loads(spec.text)
                ebnf = "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
                return compiler.compile_grammar(ebnf)
            if "::=" in spec.text:  # EBNF / GBNF, as vLLM's `grammar`
                return compiler.compile_grammar(spec.text)
            return compiler.compile_lark(spec.text)
        except (RuntimeError, ValueError, TypeError) as e:  # xgrammar's errors for a bad input
            lines = str(e).strip().splitlines() or [type(e).__name__]
            message = _SOURCE_PREFIX.sub("", lines[-1])  # "[time] /project/cpp/x.cc:94: " off
            raise InvalidRequestError(f"{spec.param}: invalid {_LABELS[spec.kind]}: {message}") from e

    def _xgrammar_compiler(self):
        if self._compiler is None:
            import xgrammar

            self._compiler = xgrammar.GrammarCompiler(
                tokenizer_info(self.tokenizer, self.vocab_size, self.stop_token_ids, xgrammar),
                max_threads=2,
                cache_enabled=False,  # ours is the cache: one place, one limit
            )
        return self._compiler


def tokenizer_info(tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int], xgrammar):
    """xgrammar's view of the vocabulary: each id's token string (byte-level, byte-fallback or
    raw, detected from the tokenizer's own JSON as xgrammar does for Hugging Face tokenizers),
    special tokens other than the stop tokens blanked (an empty token is never allowed: a
    constrained output never holds a template token), the model's vocab size (padding ids beyond
    the tokenizer's are never allowed either)."""
    backend = tokenizer.backend
    vocab = [""] * vocab_size
    for token, token_id in backend.get_vocab(with_added_tokens=True).items():
        if token_id < vocab_size:
            vocab[token_id] = token
    stops = set(stop_token_ids)
    for token_id in tokenizer.all_special_ids:
        if token_id < vocab_size and token_id not in stops:
            vocab[token_id] = ""
    meta = xgrammar.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
    return xgrammar.TokenizerInfo(
        vocab,
        meta["vocab_type"],
        vocab_size=vocab_size,
        stop_token_ids=list(stop_token_ids),
        add_prefix_space=meta["add_prefix_space"],
    )
