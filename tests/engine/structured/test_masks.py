"""Grammar masks on SmolLM2's tokenizer: the bitmask's application, a matcher that follows the
host's tokens, per-draft-position masks for speculative verification, stop tokens only where the
grammar is complete, and the compile cache."""

from __future__ import annotations

import json

import pytest
import torch

from pagedinfer.engine.core.scheduler_output import SamplingRow
from pagedinfer.engine.errors import InvalidRequestError
from pagedinfer.engine.models.builtin import builtin_path
from pagedinfer.engine.models.gguf_loader import GGUFCheckpoint
from pagedinfer.engine.sampling_params import SamplingParams
from pagedinfer.engine.structured.compiler import GrammarCompiler
from pagedinfer.engine.structured.masks import GrammarMasker, apply_token_bitmask
from pagedinfer.engine.structured.spec import GrammarKind, StructuredOutput
from pagedinfer.engine.tokenizer import Tokenizer
from pagedinfer.engine.worker.step_types import VerifyGroup

EOS = 2
VOCAB = 49152
SCHEMA = StructuredOutput.json_schema(
    {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["n"],
    },
    strict=True,
)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf(GGUFCheckpoint(builtin_path("smollm2-135m")))


@pytest.fixture
def masker(tokenizer) -> GrammarMasker:
    return GrammarMasker(GrammarCompiler(tokenizer, VOCAB, [EOS]), torch.device("cpu"))


def _allowed(bitmask: torch.Tensor, row: int) -> set[int]:
    logits = apply_token_bitmask(torch.zeros(bitmask.shape[0], VOCAB), bitmask)
    return set(torch.nonzero(logits[row] == 0).flatten().tolist())


def _row(seq_id: int, spec: StructuredOutput | None, outputs: list[int], position: int | None = None):
    params = SamplingParams(temperature=0.0, structured_output=spec)
    pos = len(outputs) if position is None else position
    return SamplingRow(seq_id, params, None, pos, [1], outputs)


def test_apply_token_bitmask_matches_bit_by_bit() -> None:
    gen = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, 4), dtype=torch.int32, generator=gen)
    logits = torch.randn(3, 100, generator=gen)
    out = apply_token_bitmask(logits, bitmask)
    for r in range(3):
        for t in range(100):
            bit = (int(bitmask[r, t // 32]) >> (t % 32)) & 1
            assert (out[r, t] == float("-inf")) == (bit == 0) and (not bit or out[r, t] == logits[r, t])


def test_masks_follow_the_host_tokens_and_allow_stop_only_when_complete(masker, tokenizer) -> None:
    doc = tokenizer.encode('{"n": 7}', add_special_tokens=False)
    free = _row(9, None, [5, 6])
    for i in range(len(doc) + 1):
        row = _row(1, SCHEMA, doc[:i])
        bitmask = masker.bitmask([row, free], [VerifyGroup(1, 0, []), VerifyGroup(9, 1, [])])
        allowed = _allowed(bitmask, 0)
        assert len(_allowed(bitmask, 1)) == VOCAB  # an unconstrained row stays so
        if i < len(doc):
            assert doc[i] in allowed and EOS not in allowed
        else:
            assert allowed == {EOS}  # complete: only a stop token
    assert masker.bitmask([free], [VerifyGroup(9, 0, [])]) is None


def test_a_matcher_is_rebuilt_from_the_tokens_alone(masker, tokenizer) -> None:
    doc = tokenizer.encode('{"n": 3}', add_special_tokens=False)
    first = masker.bitmask([_row(1, SCHEMA, doc[:3])], [VerifyGroup(1, 0, [])])
    masker._matchers.clear()  # dropped (preempted, not scheduled): the next step rebuilds it
    again = masker.bitmask([_row(1, SCHEMA, doc[:3])], [VerifyGroup(1, 0, [])])
    assert torch.equal(first, again)
    # a fork (its own seq_id, position 0) starts at the grammar's start
    fork = masker.bitmask([_row(2, SCHEMA, [])], [VerifyGroup(2, 0, [])])
    start = masker.bitmask([_row(3, SCHEMA, [])], [VerifyGroup(3, 0, [])])
    assert torch.equal(fork, start) and not torch.equal(fork, first)


def test_draft_rows_get_the_mask_after_the_drafts_before_them(masker, tokenizer) -> None:
    doc = tokenizer.encode('{"n": 5}', add_special_tokens=False)
    row = _row(1, SCHEMA, [])
    drafts = doc[:3]
    rows = [row, *[_row(1, SCHEMA, [], j) for j in range(1, 4)]]
    bitmask = masker.bitmask(rows, [VerifyGroup(1, 0, drafts)])
    for j in range(4):
        step = masker.bitmask([_row(7, SCHEMA, doc[:j])], [VerifyGroup(7, 0, [])])
        assert _allowed(bitmask, j) == _allowed(step, 0), j
    # the drafts were rolled back: the next step's mask is the first row's again
    assert torch.equal(masker.bitmask([row], [VerifyGroup(1, 0, [])])[0], bitmask[0])
    # a forbidden draft: its row cannot draw it; the rows after it repeat that row's mask
    bad = tokenizer.encode("hello", add_special_tokens=False)[0]
    bitmask = masker.bitmask(rows, [VerifyGroup(1, 0, [doc[0], bad, doc[2]])])
    assert bad not in _allowed(bitmask, 1)
    assert torch.equal(bitmask[2], bitmask[1]) and torch.equal(bitmask[3], bitmask[1])


def test_regex_choice_and_grammar_masks(masker, tokenizer) -> None:
    specs = [
        StructuredOutput(GrammarKind.REGEX, "[0-9]{2}"),
        StructuredOutput.choice(["yes", "no"]),
        StructuredOutput(GrammarKind.GRAMMAR, 'root ::= "a" | "b"'),
        StructuredOutput(GrammarKind.GRAMMAR, 'start: "a" | "b"'),
    ]
    rows = [_row(i, s, []) for i, s in enumerate(specs)]
    bitmask = masker.bitmask(rows, [VerifyGroup(i, i, []) for i in range(4)])
    digits = {tokenizer.decode([t]) for t in _allowed(bitmask, 0)}
    assert digits and all(d.isdigit() and 1 <= len(d) <= 2 for d in digits)
    assert {tokenizer.decode([t]) for t in _allowed(bitmask, 1)} >= {"yes", "no"}
    assert {tokenizer.decode([t]) for t in _allowed(bitmask, 2)} == {"a", "b"}
    assert _allowed(bitmask, 3) == _allowed(bitmask, 2)


def test_compile_cache_and_invalid_inputs_name_the_field(tokenizer) -> None:
    compiler = GrammarCompiler(tokenizer, VOCAB, [EOS], cache_size=2)
    a = StructuredOutput(GrammarKind.REGEX, "a+")
    assert compiler.compile(a) is compiler.compile(StructuredOutput(GrammarKind.REGEX, "a+", param="other"))
    assert compiler.num_compiled == 1
    compiler.compile(StructuredOutput(GrammarKind.REGEX, "b+"))
    compiler.compile(StructuredOutput(GrammarKind.REGEX, "c+"))  # evicts a+ (least recently used)
    compiler.compile(a)
    assert compiler.num_compiled == 4
    bad = [
        (
            StructuredOutput.json_schema({"type": "nope"}, param="guided_json"),
            "guided_json: invalid JSON schema",
        ),
        (StructuredOutput(GrammarKind.REGEX, "(x", param="guided_regex"), "guided_regex: invalid regex"),
        (
            StructuredOutput(GrammarKind.GRAMMAR, "root ::= y", param="g"),
            "g: invalid grammar: EBNF parser error",
        ),
    ]
    for spec, message in bad:
        with pytest.raises(InvalidRequestError, match=message):
            compiler.compile(spec)
    for make in (
        lambda: StructuredOutput.json_schema("{nope", param="p"),
        lambda: StructuredOutput.json_schema("[1]", param="p"),
        lambda: StructuredOutput.choice([], param="p"),
        lambda: StructuredOutput(GrammarKind.REGEX, " ", param="p"),
    ):
        with pytest.raises(InvalidRequestError, match="^p: "):
            make()
    assert json.loads(StructuredOutput.json_schema({"b": 1, "a": 2}).text) == {"b": 1, "a": 2}
