"""Pick a grammar engine for structured outputs: llguidance vs xgrammar on SmolLM2's vocabulary.

Measures, on this machine's CPU, for one JSON schema: the time to build the engine's tokenizer
object (once per server), to compile the schema (what the LRU cache keeps), to create a matcher
from the compiled grammar (per request), and the per-token mask time while a JSON document is
generated (the mean and the p99 over its tokens). xgrammar is optional (it declares torch,
transformers and triton as dependencies): install it beside the venv with
`pip install --no-deps --target /tmp/xg xgrammar apache-tvm-ffi` and run with PYTHONPATH=/tmp/xg.

    .venv/bin/python -P bench/grammar_engines.py
"""

from __future__ import annotations

import importlib.metadata
import json
import statistics
import time

import torch

from pagedinfer.engine.models.builtin import builtin_path
from pagedinfer.engine.models.gguf_loader import GGUFCheckpoint
from pagedinfer.engine.tokenizer import Tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
        },
    },
    "required": ["name", "age", "email", "tags", "address"],
    "additionalProperties": False,
}
REQUESTS = 5  # documents generated, each by a fresh matcher
DOCUMENT = {
    "name": "Ada Lovelace",
    "age": 36,
    "email": "ada@math.com",
    "tags": ["a", "c"],
    "address": {"city": "London", "zip": "12345"},
}


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


def measure_llguidance(tok: Tokenizer, doc_ids: list[int]) -> dict:
    import llguidance
    import llguidance.torch as lltorch

    t0 = time.perf_counter()
    lltok = llguidance.LLTokenizer(tok.backend.to_str(), n_vocab=tok.vocab_size, eos_token=tok.eos_token_id)
    t1 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    error = llguidance.LLMatcher.validate_grammar(grammar, lltok)
    t2 = time.perf_counter()
    assert not error, error
    mask = lltorch.allocate_token_bitmask(1, tok.vocab_size)
    per_token, creates = [], []
    for _ in range(REQUESTS):  # a fresh matcher per request from the cached grammar
        t2 = time.perf_counter()
        matcher = llguidance.LLMatcher(lltok, grammar)
        creates.append(time.perf_counter() - t2)
        for token_id in doc_ids:
            s = time.perf_counter()
            lltorch.fill_next_token_bitmask(matcher, mask, 0)
            per_token.append(time.perf_counter() - s)
            assert matcher.consume_token(token_id), matcher.get_error()
    t3 = t2 + statistics.median(creates)
    return _report("llguidance " + llguidance.get_version(), t1 - t0, t2 - t1, t3 - t2, per_token)


def measure_xgrammar(tok: Tokenizer, doc_ids: list[int]) -> dict | None:
    try:
        import xgrammar as xgr
    except ImportError:
        return None
    vocab = [tok.backend.id_to_token(i) or "" for i in range(tok.vocab_size)]
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo(
        vocab, xgr.VocabType.BYTE_LEVEL, vocab_size=tok.vocab_size, stop_token_ids=[tok.eos_token_id]
    )
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    t1 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA))
    t2 = time.perf_counter()
    mask = xgr.allocate_token_bitmask(1, info.vocab_size)
    per_token, creates = [], []
    for _ in range(REQUESTS):
        t2 = time.perf_counter()
        matcher = xgr.GrammarMatcher(compiled)
        creates.append(time.perf_counter() - t2)
        for token_id in doc_ids:
            s = time.perf_counter()
            matcher.fill_next_token_bitmask(mask, 0)
            per_token.append(time.perf_counter() - s)
            assert matcher.accept_token(token_id)
    t3 = t2 + statistics.median(creates)
    return _report("xgrammar " + importlib.metadata.version("xgrammar"), t1 - t0, t2 - t1, t3 - t2, per_token)


def _report(engine: str, setup: float, compile_s: float, matcher_s: float, per_token: list[float]) -> dict:
    per_token.sort()
    return {
        "engine": engine,
        "tokenizer_setup_ms": _ms(setup),
        "schema_compile_ms": _ms(compile_s),
        "matcher_create_ms": _ms(matcher_s),
        "mask_median_us": round(statistics.median(per_token) * 1e6, 1),
        "mask_mean_us": round(statistics.mean(per_token) * 1e6, 1),
        "mask_p99_us": round(per_token[int(0.99 * (len(per_token) - 1))] * 1e6, 1),
        "num_tokens": len(per_token),
    }


def main() -> None:
    torch.set_num_threads(1)
    tok = Tokenizer.from_gguf(GGUFCheckpoint(builtin_path("smollm2-135m")))
    doc_ids = tok.encode(json.dumps(DOCUMENT), add_special_tokens=False)
    for result in (measure_llguidance(tok, doc_ids), measure_xgrammar(tok, doc_ids)):
        if result is not None:
            print(json.dumps(result))


if __name__ == "__main__":
    main()
