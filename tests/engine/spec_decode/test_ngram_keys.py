"""Folded match keys of the n-gram proposer (spec_decode/ngram_keys.py): the table built from real
tokenizers, and the host proposer matching keys while drafting the exact tokens."""

from __future__ import annotations

import random

import numpy as np
import pytest

from pagedinfer.engine.config import SpeculativeConfig
from pagedinfer.engine.core.scheduler_output import SamplingRow
from pagedinfer.engine.models.gguf_loader import GGUFCheckpoint
from pagedinfer.engine.sampling_params import SamplingParams
from pagedinfer.engine.spec_decode.ngram import NgramProposer, find_ngram_draft, find_ngram_drafts
from pagedinfer.engine.spec_decode.ngram_keys import fold, folded_match_keys, match_keys
from pagedinfer.engine.spec_decode.proposer import DraftRequest
from pagedinfer.engine.tokenizer import Tokenizer
from tests.engine.test_tokenizer import _gguf_path, spm_gguf  # noqa: F401 (spm_gguf: a fixture)

# A text whose words come back spelled otherwise in its rewrite: "The" (no space, the answer's
# first word) for " The", " children" for " Children".
SOURCE = "Rewrite the text. Text: The town council met on Monday. Children under twelve read for free."


@pytest.fixture(scope="module")
def smol() -> Tokenizer:
    return Tokenizer.from_gguf(GGUFCheckpoint(_gguf_path()))


@pytest.fixture(scope="module")
def smol_keys(smol) -> np.ndarray:
    return folded_match_keys(smol, smol.vocab_size)


def _id(tok: Tokenizer, text: str) -> int:
    (token_id,) = tok.encode(text, add_special_tokens=False)
    return token_id


def test_fold():
    assert fold(" The") == fold("The") == fold("  the") == "the"
    assert fold("\ufffd") == fold("   ") == ""  # a byte of a longer character; only spaces
    assert fold("\nThe") == "\nthe"  # a newline is part of the word's token: kept


def test_smollm2_spellings_share_a_key(smol, smol_keys):
    spellings = [_id(smol, w) for w in (" The", "The", " the", "the")]
    assert len(set(spellings)) == 4
    assert len({int(smol_keys[i]) for i in spellings}) == 1
    assert smol_keys[spellings[0]] == min(spellings)  # the class's smallest id
    assert smol_keys[_id(smol, " Children")] == smol_keys[_id(smol, " children")]
    assert smol_keys[_id(smol, " town")] != smol_keys[_id(smol, " the")]
    for special in smol.all_special_ids:  # never merged with the text spelled like them
        assert smol_keys[special] == special
    # every key is a class's own key, and a token of another word keeps its own class
    assert (smol_keys[smol_keys] == smol_keys).all()
    assert (smol_keys <= np.arange(smol_keys.shape[0])).all()


def test_padded_vocabulary_keys_itself(smol):
    keys = folded_match_keys(smol, smol.vocab_size + 64)
    assert keys.shape == (smol.vocab_size + 64,)
    assert (keys[smol.vocab_size :] == np.arange(smol.vocab_size, smol.vocab_size + 64)).all()


def test_sentencepiece_spellings_share_a_key(spm_gguf):  # noqa: F811 (the fixture)
    tok = Tokenizer.from_gguf(GGUFCheckpoint(spm_gguf))
    keys = folded_match_keys(tok, tok.vocab_size)
    he, space_he = tok.token_to_id("he"), tok.token_to_id("▁he")
    assert keys[space_he] == keys[he] == min(he, space_he)
    assert keys[tok.token_to_id("▁the")] != keys[he]


def test_match_modes(smol):
    assert match_keys("exact", smol, 10) is None
    assert match_keys("folded", None, 10) is None  # nothing to fold with: ids
    assert match_keys("folded", smol, 10).shape == (smol.vocab_size,)
    with pytest.raises(ValueError, match="unknown speculative ngram_match 'fuzzy'"):
        match_keys("fuzzy", smol, 10)
    assert SpeculativeConfig().ngram_match == "folded"


def test_answer_start_finds_the_source(smol, smol_keys):
    """The answer's first token "The" never occurs in the prompt: exact ids find nothing, keys
    find " The" and draft the exact tokens after it."""
    prompt = smol.encode(SOURCE, add_special_tokens=False)
    the = _id(smol, "The")
    assert the not in prompt
    tokens = np.array([*prompt, the], dtype=np.int32)
    after = prompt.index(_id(smol, " The")) + 1
    assert find_ngram_draft(tokens, 1, 3, 4).tolist() == []
    got = find_ngram_draft(tokens, 1, 3, 4, match_keys=smol_keys)
    assert got.tolist() == prompt[after : after + 4]
    assert smol.decode(got.tolist()) == " town council met on"


def test_proposer_drafts_exact_tokens_after_a_folded_match(smol, smol_keys):
    prompt = smol.encode(SOURCE, add_special_tokens=False)
    outputs = [_id(smol, "The"), *smol.encode(" town council met on Monday.", add_special_tokens=False)]
    outputs.append(_id(smol, " children"))
    rows = [
        SamplingRow(s, SamplingParams(), None, n, prompt, outputs[:n])
        for s, n in enumerate((1, len(outputs), 1))
    ]
    requests = [DraftRequest(row, 4) for row in rows]
    folded = NgramProposer(1, 3, 4, match_keys=smol_keys).propose(requests).token_ids
    exact = NgramProposer(1, 3, 4).propose(requests).token_ids
    assert smol.decode(folded[0]) == " town council met on"
    assert smol.decode(folded[1]) == " under twelve read for"
    assert exact == [[], [], []]
    # three sequences: the batched path (one gather of keys over all of them)
    assert folded[2] == folded[0]


def test_batched_keys_equal_one_by_one():
    """find_ngram_drafts with match keys gives each sequence find_ngram_draft's draft: ids first,
    keys where they match nowhere (ids 0..29, keys 100 + id % 4: not ids); the keys add drafts,
    never change one the ids found, and drafts are ids."""
    rng = random.Random(7)
    table = (100 + np.arange(30) % 4).astype(np.int32)
    added = 0
    for _ in range(200):
        seqs = [
            np.array([rng.randrange(30) for _ in range(rng.randint(0, 40))], dtype=np.int32) for _ in range(4)
        ]
        k = np.array([rng.randint(0, 5) for _ in seqs])
        lengths = np.array([s.shape[0] for s in seqs])
        flat = np.concatenate(seqs)
        starts = np.cumsum(lengths) - lengths
        got = find_ngram_drafts(flat, starts, lengths, 1, 3, k, match_keys=table)
        for s, kk, g in zip(seqs, k, got, strict=True):
            want = find_ngram_draft(s, 1, 3, int(kk), match_keys=table).tolist()
            exact = find_ngram_draft(s, 1, 3, int(kk)).tolist()
            assert g == want
            assert want == exact or not exact  # keys only fill in
            added += bool(want) and not exact
            assert set(want) <= set(s.tolist())
    assert added > 50


def test_factory_gives_the_proposer_and_the_chain_the_keys(smol, smol_keys):
    from types import SimpleNamespace

    from pagedinfer.engine.spec_decode.factory import build_speculative_decoder

    model = SimpleNamespace(config=SimpleNamespace(vocab_size=smol.vocab_size), device="cpu")
    kwargs = dict(num_blocks=8, block_size=4, max_model_len=64)
    folded = build_speculative_decoder(SpeculativeConfig(method="ngram"), model, smol, **kwargs)
    assert (folded.proposer.match_keys == smol_keys).all()
    assert (folded.device_chain.match_keys.numpy() == smol_keys).all()
    exact = build_speculative_decoder(
        SpeculativeConfig(method="ngram", ngram_match="exact"), model, smol, **kwargs
    )
    assert exact.proposer.match_keys is None and exact.device_chain.match_keys is None
    with pytest.raises(ValueError, match="unknown speculative ngram_match"):
        build_speculative_decoder(
            SpeculativeConfig(method="ngram", ngram_match="loose"), model, smol, **kwargs
        )


def test_chain_drafts_as_the_host_proposer(smol, smol_keys):
    """A chain's first step (CPU torch path) drafts with the keys as NgramProposer does: the
    answer's first token "The" finds the text's " The"."""
    import torch

    from pagedinfer.engine.spec_decode.device_chain import DeviceNgramChain

    prompt = smol.encode(SOURCE, add_special_tokens=False)
    the = _id(smol, "The")
    for keys in (smol_keys, None):
        chain = DeviceNgramChain(2, 128, 4, 1, 3, torch.device("cpu"), "reference", match_keys=keys)
        chain.start([prompt])
        step = chain.accept(torch.tensor([the]), [0], [[]], None)  # no drafts: emits "The"
        row = SamplingRow(0, SamplingParams(), None, 1, prompt, [the])
        host = NgramProposer(1, 3, 4, match_keys=keys).propose([DraftRequest(row, 4)]).token_ids[0]
        has_match = bool(step.packed[0, 3])
        assert (step.packed[0, -4:].tolist() if has_match else []) == host
        assert bool(host) == (keys is not None)
