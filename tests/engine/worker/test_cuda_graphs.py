"""Graph keys, graph selection and graph-shaped (padded) inputs, on the CPU.

CUDA graphs need a GPU (tests/engine/test_engine_gpu.py); what they replay does not: here a
runner "replays" by running the model eagerly on the padded static buffers with the metadata a
graph is captured with, so padding (fake sequences, the sink row) and the fixed max_query_len of
verification graphs go through the whole engine and must leave greedy output unchanged.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pagedinfer.engine.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from pagedinfer.engine.llm import LLM
from pagedinfer.engine.sampling_params import SamplingParams
from pagedinfer.engine.worker.cuda_graphs import CudaGraphRunner, GraphKey, graph_keys, select_key
from pagedinfer.engine.worker.input_batch import InputBatch

GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


def test_graph_keys_cover_decode_everywhere_and_verification_up_to_its_batch_limit():
    keys = graph_keys([1, 2, 4, 8, 16], (1, 5), max_num_tokens=32, max_verify_seqs=8)
    assert [(k.num_seqs, k.query_len) for k in keys] == [
        (1, 1),
        (2, 1),
        (4, 1),
        (8, 1),
        (16, 1),
        (1, 5),
        (2, 5),
        (4, 5),
    ]  # fmt: skip  (8 x 5 = 40 rows exceed the 32-row buffers; 16 exceeds max_verify_seqs)


@pytest.mark.parametrize(
    ("num_seqs", "max_query_len", "expected"),
    [
        (3, 1, GraphKey(4, 1)),  # decode: smallest bucket
        (3, 5, GraphKey(4, 5)),  # every sequence brings 1 + K tokens
        (3, 2, GraphKey(4, 5)),  # fewer drafts (or a 2-token prefill chunk) ride in the K graph
        (1, 6, None),  # longer than 1 + K: eager
        (5, 5, None),  # more sequences than the verification buckets: eager
        (16, 1, GraphKey(16, 1)),
        (17, 1, None),
        (0, 1, None),
    ],
)
def test_select_key(num_seqs, max_query_len, expected):
    keys = graph_keys([1, 2, 4, 8, 16], (1, 5), max_num_tokens=64, max_verify_seqs=4)
    assert select_key(keys, num_seqs, max_query_len) == expected


def _layout(q_lens: list[int], ctx: list[int], block_size: int = 4):
    """A ragged batch whose sequence b uses blocks 10b, 10b + 1, ..."""
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    pos = np.concatenate([np.arange(c - q, c) for q, c in zip(q_lens, ctx, strict=True)]).astype(np.int32)
    owner = np.repeat(np.arange(len(q_lens)), q_lens)
    width = max(-(-c // block_size) for c in ctx)
    tables = (10 * np.arange(len(q_lens))[:, None] + np.arange(width)[None, :]).astype(np.int32)
    slots = tables[owner, pos // block_size] * block_size + pos % block_size
    return SimpleNamespace(
        block_tables=tables,
        slot_mapping=slots.astype(np.int32),
        positions=pos,
        context_lens=np.asarray(ctx, dtype=np.int32),
        query_start_loc=qsl,
    )


def test_verification_graph_metadata_pads_with_sequences_of_at_most_q_rows():
    batch = InputBatch(
        max_num_tokens=64, max_num_seqs=8, max_blocks_per_seq=16, scratch_block=99, block_size=4,
        device=torch.device("cpu"),
    )  # fmt: skip
    key = GraphKey(4, 5)
    layout = _layout([5, 3], [9, 20])  # two sequences, one with 4 drafts, one with 2
    ids = np.arange(8, dtype=np.int64) + 100
    inputs = batch.stage(ids, layout, np.array([0, 1, 2, 3, 4, 5, 6, 7]), key)
    md = inputs.attn_metadata
    assert inputs.input_ids.shape == (20,) and md.slot_mapping.shape == (20,)
    assert md.max_query_len == 5 and not md.is_pure_decode
    assert md.block_tables.shape == (8, 16) and md.seq_lens.shape == (8,)
    # Two real sequences, then the 12 rows left in pad sequences of at most q = 5 rows.
    assert md.query_start_loc.tolist() == [0, 5, 8, 13, 18, 20, 20, 20, 20]
    assert md.seq_lens.tolist() == [9, 20, 5, 5, 2, 1, 1, 1]
    assert inputs.input_ids[:8].tolist() == ids.tolist()
    assert (md.slot_mapping[8:] == 99 * 4).all() and (md.block_tables[2:] == 99).all()
    assert md.positions[8:].tolist() == [0, 1, 2, 3, 4] * 2 + [0, 1]
    assert md.logits_indices.tolist() == list(range(8))
    with pytest.raises(ValueError, match="do not fit"):
        batch.stage(np.zeros(11, dtype=np.int64), _layout([5, 5, 1], [5, 5, 1]), np.zeros(0), GraphKey(2, 5))


def test_decode_graph_metadata_has_no_sink():
    batch = InputBatch(
        max_num_tokens=16, max_num_seqs=8, max_blocks_per_seq=4, scratch_block=7, block_size=4,
        device=torch.device("cpu"),
    )  # fmt: skip
    inputs = batch.stage(np.array([5, 6, 7]), _layout([1, 1, 1], [3, 4, 5]), np.arange(3), GraphKey(4, 1))
    md = inputs.attn_metadata
    assert md.is_pure_decode and md.max_query_len == 1
    assert md.query_start_loc.tolist() == [0, 1, 2, 3, 4] and md.seq_lens.tolist() == [3, 4, 5, 1]


class EagerReplay(CudaGraphRunner):
    """A CPU stand-in for captured graphs: same selection, same padded buffers, eager model."""

    def capture(self) -> None:
        self._graphs = dict.fromkeys(self.keys)
        self.replayed: list[GraphKey] = []

    def replay(self, key: GraphKey) -> torch.Tensor:
        self.replayed.append(key)
        b = self.batch
        return self.model(
            b.ids[: key.num_tokens], b.pos[: key.num_tokens], self.kv_caches, b.graph_metadata(key)
        )


def make_llm(folder, spec: SpeculativeConfig | None = None) -> LLM:
    config = EngineConfig(
        model=str(folder),
        cache=CacheConfig(block_size=4, num_blocks=256),
        scheduler=SchedulerConfig(max_model_len=128, max_num_seqs=8),
        device=DeviceConfig(device="cpu", dtype="float32"),
        speculative=spec or SpeculativeConfig(),
    )
    return LLM(config)


def with_eager_replay(llm: LLM, k: int) -> EagerReplay:
    runner = llm.core.runner
    keys = graph_keys([1, 2, 4, 8], (1, 1 + k), runner.batch.max_num_tokens, max_verify_seqs=8)
    runner.graphs = EagerReplay(runner.model, runner.kv_caches, runner.batch, keys)
    runner.graphs.capture()
    return runner.graphs


def test_graph_shaped_speculative_steps_keep_greedy_output(tiny_llama_dir):
    ps = [[5, 6, 7, 8, 9] * 4, [11, 12] * 8, [3, 4, 5], [20, 21, 22, 23] * 3, [40, 41] * 6]
    plain = make_llm(tiny_llama_dir)
    expected = [o.token_ids for o in plain.generate(prompt_token_ids=ps, sampling_params=GREEDY)]
    llm = make_llm(tiny_llama_dir, SpeculativeConfig(method="ngram", num_speculative_tokens=3))
    graphs = with_eager_replay(llm, 3)
    got = [o.token_ids for o in llm.generate(prompt_token_ids=ps, sampling_params=GREEDY)]
    assert got == expected
    # Verification graphs were used (also padded ones: 5 sequences in bucket 8), and decode graphs.
    assert GraphKey(8, 4) in graphs.replayed and any(k.query_len == 1 for k in graphs.replayed)
    assert llm.core.spec_decoder.stats.num_accepted_tokens > 0
    kv = llm.core.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks


def _silence_last_layer(llm: LLM) -> None:
    """Zero layer 1's output projections: the target then equals its layer-0 self-draft, so
    every draft is accepted and the draft's two-token catch-up steps occur."""
    layer = llm.core.runner.model.model.layers[1]
    with torch.no_grad():
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()


def test_graph_shaped_draft_model_steps_keep_greedy_output(tiny_llama_dir):
    """Self-draft: the target's verification and the draft's own steps both go through graphs."""
    ps = [[5, 6, 7, 8, 9] * 4, [11, 12] * 8, [3, 4, 5], [20, 21, 22, 23] * 3, [40, 41] * 6]
    plain = make_llm(tiny_llama_dir)
    _silence_last_layer(plain)
    expected = [o.token_ids for o in plain.generate(prompt_token_ids=ps, sampling_params=GREEDY)]
    spec = SpeculativeConfig(method="draft", num_speculative_tokens=3, draft_model="self:layers=0")
    llm = make_llm(tiny_llama_dir, spec)
    _silence_last_layer(llm)
    target_graphs = with_eager_replay(llm, 3)
    proposer = llm.core.spec_decoder.proposer
    uncaptured = proposer.graph_runner(max_num_seqs=8, max_model_len=128)
    proposer.graphs = EagerReplay(proposer.model, proposer.kv_caches, uncaptured.batch, uncaptured.keys)
    proposer.graphs.capture()
    got = [o.token_ids for o in llm.generate(prompt_token_ids=ps, sampling_params=GREEDY)]
    assert got == expected
    stats = llm.core.spec_decoder.stats
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0
    assert any(k.query_len == 4 for k in target_graphs.replayed)
    # Draft steps of one token and catch-ups of two ran on the padded draft buffers.
    assert {k.query_len for k in proposer.graphs.replayed} == {1, 2}
    assert proposer.kv.num_free_blocks == proposer.kv.num_blocks


def test_logits_rows_may_outnumber_the_token_budget():
    """Fork rows (n > 1 children sampling from their leader's last row) come on top of one row per
    token: a step of the full token budget with max_num_seqs - 1 fork rows stages them all."""
    batch = InputBatch(
        max_num_tokens=5, max_num_seqs=5, max_blocks_per_seq=4, scratch_block=9, block_size=4,
        device=torch.device("cpu"),
    )  # fmt: skip
    layout = _layout([4, 1], [8, 3])  # a verifying sequence (4 rows) and a prompt's last token
    rows = np.array([0, 1, 2, 3, 4, 4, 4, 4])  # + 3 fork rows of the prompt's leader
    md = batch.stage(np.arange(5, dtype=np.int64), layout, rows).attn_metadata
    assert md.logits_indices.tolist() == rows.tolist()


def test_staging_sets_are_used_in_turn():
    """Each stage takes the next pinned staging set, cycling through `num_staging_sets` (a draft
    model stages its K chained steps at once; a set comes back only after all the others)."""
    batch = InputBatch(
        max_num_tokens=4, max_num_seqs=2, max_blocks_per_seq=4, scratch_block=9, block_size=4,
        device=torch.device("cpu"), num_staging_sets=3,
    )  # fmt: skip
    layout = _layout([1], [3])
    used = []
    for _ in range(4):
        batch.stage(np.zeros(1, dtype=np.int64), layout, np.array([0]))
        used.append(batch.ids_host.data_ptr())
    assert len(set(used[:3])) == 3 and used[3] == used[0]
