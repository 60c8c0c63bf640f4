"""Where prompt lookup expects a sequence to stop (NgramProposer.tokens_to_stop and
SpeculativeDecoder.tokens_to_stop): the planner's bound on the device steps a chain still needs
when a copied text runs into what ended its source."""

from __future__ import annotations

from pagedinfer.engine.config import SpeculativeConfig
from pagedinfer.engine.core.scheduler_output import SamplingRow
from pagedinfer.engine.request import Request
from pagedinfer.engine.sampling_params import SamplingParams
from pagedinfer.engine.spec_decode.controller import SpeculativeDecoder
from pagedinfer.engine.spec_decode.ngram import NgramProposer

EOS = 2
# A prompt quoting a text (10 11 12 13 14 15) that ends the user's turn (EOS), then an answer
# that has copied the text up to 12: lookup continues 13 14 15 EOS.
PROMPT = [1, 50, 10, 11, 12, 13, 14, 15, EOS, 51, 52]
OUTPUT = [10, 11, 12]


def _row(output: list[int], position: int | None = None, **params) -> SamplingRow:
    sp = SamplingParams(max_tokens=100, temperature=0.0, **params)
    return SamplingRow(0, sp, None, len(output) if position is None else position, PROMPT, output)


def _proposer() -> NgramProposer:
    return NgramProposer(ngram_min=1, ngram_max=3, num_speculative_tokens=4)


def test_the_lookup_continuation_reaches_the_stop_token():
    ngram = _proposer()
    assert ngram.tokens_to_stop(_row(OUTPUT), frozenset({EOS}), 16) == 4  # 13 14 15 EOS
    assert ngram.tokens_to_stop(_row(OUTPUT), frozenset({EOS}), 3) is None  # beyond the horizon
    assert ngram.tokens_to_stop(_row(OUTPUT), frozenset({15, EOS}), 16) == 3  # the first stop id
    assert ngram.tokens_to_stop(_row(OUTPUT), frozenset({99}), 16) is None  # none in the text
    assert ngram.tokens_to_stop(_row(OUTPUT), frozenset({2**31, -1, EOS}), 16) == 4  # ids past int32
    assert ngram.tokens_to_stop(_row(OUTPUT), frozenset(), 16) is None
    assert ngram.tokens_to_stop(_row([60, 61]), frozenset({EOS}), 16) is None  # nothing matches
    # the cache follows the growing output
    assert ngram.tokens_to_stop(_row([*OUTPUT, 13, 14]), frozenset({EOS}), 16) == 2


def test_the_decoder_counts_from_the_step_in_flight_and_respects_min_tokens_and_ignore_eos():
    ngram = _proposer()
    spec = SpeculativeDecoder(SpeculativeConfig(method="ngram", num_speculative_tokens=4), ngram, 512)

    def seq(**params) -> Request:
        sp = SamplingParams(max_tokens=100, temperature=0.0, **params)
        return Request(0, "r", 0, PROMPT, sp, 0.0, eos_token_ids=(EOS,), output_token_ids=list(OUTPUT))

    assert spec.tokens_to_stop(seq(), _row(OUTPUT), 16) == 4
    # the step in flight starts 2 outputs past those applied: 2 of the 4 are behind it
    assert spec.tokens_to_stop(seq(), _row(OUTPUT, position=5), 16) == 2
    assert spec.tokens_to_stop(seq(ignore_eos=True), _row(OUTPUT, ignore_eos=True), 16) is None
    assert spec.tokens_to_stop(seq(stop_token_ids=[14]), _row(OUTPUT), 16) == 2
    # the EOS would be the 7th output: min_tokens 7 keeps it from stopping there, 6 does not
    assert spec.tokens_to_stop(seq(min_tokens=7), _row(OUTPUT, min_tokens=7), 16) is None
    assert spec.tokens_to_stop(seq(min_tokens=6), _row(OUTPUT, min_tokens=6), 16) == 4
    # the tokens the proposer cached for it go when the sequence is gone from the running set
    assert ngram._cache._arrays
    spec.propose([])
    assert not ngram._cache._arrays
