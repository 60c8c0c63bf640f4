"""Adaptive speculation policy, layer-subset specs and the draft vocabulary check."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pagedinfer.engine.config import SpeculativeConfig
from pagedinfer.engine.spec_decode.draft_model import DraftModelError, check_same_vocabulary
from pagedinfer.engine.spec_decode.factory import build_speculative_decoder
from pagedinfer.engine.spec_decode.policy import SpeculationPolicy, SpeculationStats
from pagedinfer.engine.spec_decode.self_draft import parse_layer_ids


def test_step_switch_follows_method_and_batch_size():
    assert not SpeculationPolicy(SpeculativeConfig(method=None)).is_step_enabled(1)
    policy = SpeculationPolicy(SpeculativeConfig(method="ngram", max_batch_size=4))
    assert policy.is_step_enabled(4) and not policy.is_step_enabled(5)


def test_low_acceptance_pauses_then_probes_again():
    policy = SpeculationPolicy(SpeculativeConfig(method="ngram", min_acceptance_rate=0.3), probe_interval=3)
    for _ in range(10):
        assert policy.should_speculate(7)
        policy.observe(7, 4, 0)
        if policy._seqs[7].paused_steps_left:
            break
    assert [policy.should_speculate(7) for _ in range(3)] == [False, False, True]
    policy.observe(7, 4, 4)  # the probe succeeds: it keeps speculating
    assert policy.should_speculate(7) and policy.should_speculate(7)
    assert policy.should_speculate(99)  # unknown sequences always try


def test_the_pause_reads_per_token_acceptance_whatever_k():
    """One accepted draft then a rejection is a per-token rate of 1/2 at any K: a sequence with
    alpha ~0.5 keeps speculating at K 6 (accepted / K would read 1/6 and pause it)."""
    for k in (2, 6):
        policy = SpeculationPolicy(SpeculativeConfig(method="ngram", min_acceptance_rate=0.3))
        for _ in range(30):
            policy.observe(3, k, 1)
            assert policy.should_speculate(3), k
        assert abs(policy._seqs[3].acceptance_ema - 0.5) < 0.01
    policy = SpeculationPolicy(SpeculativeConfig(method="ngram", min_acceptance_rate=0.3))
    for _ in range(30):  # all K accepted: rate 1
        policy.observe(4, 6, 6)
    assert policy._seqs[4].acceptance_ema > 0.99


def _geometric_outcome(rng, alpha: float, k: int) -> int:
    """Accepted drafts of one verification when each is accepted with probability alpha in turn."""
    accepted = 0
    while accepted < k and rng.random() < alpha:
        accepted += 1
    return accepted


def test_the_pause_estimates_alpha_without_bias():
    """With random per-token acceptance the policy's estimate centres on alpha itself (an average
    of per-step ratios read alpha 0.46 as ~0.29 at K 4 and paused such sequences ~20-40% of the
    steps): alpha 0.46 stays on at K 4 and 6; alpha 0.05 sits out most steps (probes excepted)."""
    import random

    rng = random.Random(0)
    for alpha, k, low, high in ((0.46, 4, 0.95, 1.0), (0.46, 6, 0.95, 1.0), (0.05, 4, 0.0, 0.4)):
        policy = SpeculationPolicy(SpeculativeConfig(method="ngram", min_acceptance_rate=0.2))
        drafted = 0
        for _ in range(4000):
            if policy.should_speculate(1):
                drafted += 1
                policy.observe(1, k, _geometric_outcome(rng, alpha, k))
        assert low <= drafted / 4000 <= high, (alpha, k, drafted)


def test_a_paused_sequence_that_recovers_while_riding_along_resumes():
    """Observations arrive while a paused sequence rides along beside drafting ones: once its
    estimate is back over the threshold the pause ends."""
    policy = SpeculationPolicy(SpeculativeConfig(method="ngram", min_acceptance_rate=0.3))
    for _ in range(5):
        policy.observe(2, 4, 0)
    assert policy._seqs[2].paused_steps_left > 0  # 5 verifications with nothing accepted
    for _ in range(10):
        policy.observe(2, 4, 4)
    assert policy.should_speculate(2)


def test_high_acceptance_never_pauses():
    policy = SpeculationPolicy(SpeculativeConfig(method="ngram", min_acceptance_rate=0.3))
    for _ in range(50):
        policy.observe(1, 4, 3)
        assert policy.should_speculate(1)


def test_stats_ratios():
    stats = SpeculationStats(
        num_draft_tokens=10, num_accepted_tokens=4, num_verified_sequences=4, num_emitted_tokens=8
    )
    assert stats.acceptance_rate == 0.4 and stats.mean_accepted_length == 2.0
    assert SpeculationStats().acceptance_rate == 0.0


def test_parse_layer_ids():
    assert parse_layer_ids("self:layers=0-2,7", 10) == [0, 1, 2, 7]
    assert parse_layer_ids("self:first=3", 10) == [0, 1, 2]
    for bad in ["self:first=10", "self:layers=0-12", "self:layers=a", "self:depth=3", "self:first=0"]:
        with pytest.raises(ValueError):
            parse_layer_ids(bad, 10)


def _tok(vocab: dict[str, int]):
    return SimpleNamespace(backend=SimpleNamespace(get_vocab=lambda with_added_tokens=True: dict(vocab)))


def test_vocabulary_check():
    check_same_vocabulary(_tok({"a": 0, "b": 1}), _tok({"a": 0, "b": 1}))
    with pytest.raises(DraftModelError, match="differs"):
        check_same_vocabulary(_tok({"a": 0, "b": 1}), _tok({"a": 1, "b": 0}))
    with pytest.raises(DraftModelError):
        check_same_vocabulary(_tok({"a": 0}), None)


def test_factory_rejects_bad_configuration():
    kwargs = dict(num_blocks=8, block_size=4, max_model_len=64)
    assert build_speculative_decoder(SpeculativeConfig(), None, None, **kwargs) is None
    with pytest.raises(ValueError, match="unknown speculative method"):
        build_speculative_decoder(SpeculativeConfig(method="medusa"), None, None, **kwargs)
    with pytest.raises(DraftModelError, match="draft_model"):
        build_speculative_decoder(SpeculativeConfig(method="draft"), None, None, **kwargs)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        build_speculative_decoder(
            SpeculativeConfig(method="ngram", num_speculative_tokens=0), None, None, **kwargs
        )


def test_paused_sequences_ride_along_unless_nobody_drafts():
    """A paused sequence drafts anyway in a step where another sequence drafts (the draft model
    runs regardless); only when every sequence is paused does the step go without drafts, and
    those sequence-steps are counted as paused (the benchmark compares them with the verifying
    ones)."""
    from pagedinfer.engine.request import Request, RequestStatus
    from pagedinfer.engine.sampling_params import SamplingParams
    from pagedinfer.engine.spec_decode.controller import SpeculativeDecoder
    from pagedinfer.engine.spec_decode.proposer import DraftProposals

    class FixedDrafts:
        def propose(self, requests):
            return DraftProposals(token_ids=[[5] * r.max_draft_tokens for r in requests], probs=None)

        def free(self, seq_id):
            pass

    config = SpeculativeConfig(method="ngram", num_speculative_tokens=2, min_acceptance_rate=0.3)
    decoder = SpeculativeDecoder(config, FixedDrafts(), max_model_len=64)
    seqs = [
        Request(i, f"r{i}", 0, [1, 2, 3], SamplingParams(max_tokens=20), 0.0, num_computed_tokens=2)
        for i in range(2)
    ]
    for seq in seqs:
        seq.status = RequestStatus.RUNNING

    def pause(seq_id: int) -> None:
        while not decoder.policy._seqs.get(seq_id) or not decoder.policy._seqs[seq_id].paused_steps_left:
            decoder.policy.observe(seq_id, 2, 0)  # its drafts keep failing until it pauses

    pause(0)
    assert decoder.propose(seqs) == 4  # sequence 1 drafts, so paused sequence 0 rides along
    assert seqs[0].spec_token_ids == [5, 5] and seqs[1].spec_token_ids == [5, 5]
    assert decoder.stats.num_paused_sequence_steps == 0
    assert decoder.policy._seqs[0].paused_steps_left > 0  # the pause still runs its course
    for seq in seqs:
        seq.spec_token_ids = []
    pause(1)
    assert decoder.propose(seqs) == 0  # both paused: no drafts this step
    assert seqs[0].spec_token_ids == [] and seqs[1].spec_token_ids == []
    assert decoder.stats.num_paused_sequence_steps == 2
