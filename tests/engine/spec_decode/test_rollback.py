"""KV rollback under speculative decoding: random drafts, random accept/reject, forked sequences.

A fake runner stands in for the model and emulates the device KV cache: every scheduled token
writes a fingerprint of its whole prefix into its slot (COW block copies first), and every
sequence then "attends" over all its context slots, which must hold exactly the fingerprints
of its own current tokens. A write into a block shared with another sequence, a rejected
draft's K/V left visible, or a lost copy all break that check. Block accounting is checked by
the block manager's own invariant checker every step and must return to empty at the end.
"""

from __future__ import annotations

import importlib.util
import random

import pytest

from pagedinfer.engine.config import SchedulerConfig, SpeculativeConfig
from pagedinfer.engine.core.kv_cache_manager import KVCacheManager
from pagedinfer.engine.core.scheduler import Scheduler
from pagedinfer.engine.core.scheduler_output import ModelRunnerOutput, SampledTokens, SchedulerOutput
from pagedinfer.engine.request import Request
from pagedinfer.engine.sampling_params import SamplingParams
from pagedinfer.engine.spec_decode.controller import SpeculativeDecoder
from pagedinfer.engine.spec_decode.proposer import DraftProposals, DraftRequest

BACKENDS = ["ref"]
if importlib.util.find_spec("pagedinfer._native") is not None:
    BACKENDS.insert(0, "native")


def _factory(name: str):
    if name == "ref":
        from pagedinfer.engine.core.block_pool_ref import BlockManager
    else:
        from pagedinfer._native import BlockManager
    return lambda n, b, p: BlockManager(n, b, p)


class RandomProposer:
    """Random drafts of random length (0..max) from a small alphabet, so some get accepted."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.freed: list[int] = []

    def propose(self, requests: list[DraftRequest]) -> DraftProposals:
        drafts = [
            [self.rng.randrange(3, 9) for _ in range(self.rng.randint(0, r.max_draft_tokens))]
            for r in requests
        ]
        return DraftProposals(token_ids=drafts)

    def free(self, seq_id: int) -> None:
        self.freed.append(seq_id)


class FakeDevice:
    """Slot -> fingerprint of (all tokens up to and including the one written there)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.slots: list[object] = [None] * (num_blocks * block_size)

    def copy_block(self, src: int, dst: int) -> None:
        bs = self.block_size
        self.slots[dst * bs : (dst + 1) * bs] = self.slots[src * bs : (src + 1) * bs]

    def run(self, scheduler: Scheduler, sched: SchedulerOutput, rng: random.Random) -> ModelRunnerOutput:
        layout = sched.layout
        for src, dst in sched.block_copies:
            self.copy_block(src, dst)
        sampled = []
        for b, s in enumerate(sched.sequences):
            seq = scheduler.get_sequence(s.seq_id)
            tokens = seq.all_token_ids + seq.spec_token_ids  # what the step computes over
            start = int(layout.query_start_loc[b])
            for i in range(s.num_new_tokens):  # write: K/V of each new token
                pos = s.num_computed_tokens + i
                self.slots[int(layout.slot_mapping[start + i])] = tuple(tokens[: pos + 1])
            context = int(layout.context_lens[b])
            for pos in range(context):  # read: attention sees the whole context
                block = int(layout.block_tables[b, pos // self.block_size])
                got = self.slots[block * self.block_size + pos % self.block_size]
                assert got == tuple(tokens[: pos + 1]), f"stale or foreign K/V at seq {s.seq_id} pos {pos}"
            if s.sample is None:
                continue
            drafts = s.token_ids[len(s.token_ids) - s.num_spec_tokens :] if s.num_spec_tokens else []
            accepted = rng.randint(0, len(drafts))
            sampled.append(SampledTokens(s.seq_id, [*drafts[:accepted], rng.randrange(3, 9)]))
            for row in s.fork_rows:
                sampled.append(SampledTokens(row.seq_id, [rng.randrange(3, 9)]))
        return ModelRunnerOutput(sampled)


def _requests(rng: random.Random, num: int) -> list[list[Request]]:
    shared = [rng.randrange(3, 9) for _ in range(6)]  # common prefix: prefix-cache hits
    groups, seq_id = [], 0
    for r in range(num):
        n = rng.choice([1, 1, 2, 3])
        prompt = shared[: rng.randint(0, 6)] + [rng.randrange(3, 9) for _ in range(rng.randint(1, 9))]
        params = SamplingParams(n=n, max_tokens=rng.randint(1, 24), ignore_eos=True, temperature=0.0)
        group = []
        for index in range(n):
            seq_id += 1
            group.append(Request(seq_id, f"r{r}", index, list(prompt), params, arrival_time=float(r)))
        groups.append(group)
    return groups


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed", range(4))
def test_random_accept_reject_with_forks_keeps_kv_exact(backend, seed):
    _drive(backend, seed)


def test_the_check_catches_a_missing_rollback(monkeypatch):
    monkeypatch.setattr(KVCacheManager, "truncate", lambda self, seq_id, num_tokens: [])
    with pytest.raises(AssertionError):
        _drive("ref", 0)


def _drive(backend: str, seed: int) -> None:
    rng = random.Random(seed)
    num_blocks, block_size = rng.choice([(12, 4), (40, 4), (30, 2)])
    kv = KVCacheManager(num_blocks, block_size, backend_factory=_factory(backend))
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=rng.choice([8, 64])), kv, max_model_len=64)
    proposer = RandomProposer(rng)
    spec = SpeculativeDecoder(SpeculativeConfig(method="ngram", num_speculative_tokens=4), proposer, 64)
    device = FakeDevice(num_blocks, block_size)
    for group in _requests(rng, 8):
        scheduler.add_request(group[0], group[1:])
    num_steps = 0
    while scheduler.has_unfinished():
        sched = scheduler.schedule()
        result = device.run(scheduler, sched, rng) if not sched.is_empty else ModelRunnerOutput([])
        scheduler.update(sched, result)
        spec.after_step(sched, result, scheduler.running)
        kv._blocks.check_invariants()
        sampled_ids = {t.seq_id for t in result.sampled}
        for seq in scheduler.running:
            num_kv = kv.num_tokens(seq.seq_id)
            if seq.seq_id in sampled_ids:  # just sampled: K/V of the accepted tokens only, no draft
                assert num_kv == seq.num_computed_tokens == seq.num_tokens - 1
            else:  # (re)admitted: allocated whole, computed in chunks
                assert seq.num_computed_tokens <= num_kv <= seq.num_tokens
            assert len(kv.block_table(seq.seq_id)) == -(-num_kv // block_size)
        num_steps += 1
        assert num_steps < 2000, "no progress"
    assert (
        spec.stats.num_draft_tokens > 0 and 0 < spec.stats.num_accepted_tokens < spec.stats.num_draft_tokens
    )
    assert kv.num_free_blocks == num_blocks
    assert kv.stats().get("used_blocks", 0.0) == 0.0
