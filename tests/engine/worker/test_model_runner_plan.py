"""ModelRunner's decode fast paths (sampling plan, collect) against its general paths."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedinfer.engine.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig
from pagedinfer.engine.core.scheduler_output import (
    BatchLayout,
    SamplingRow,
    ScheduledSequence,
    SchedulerOutput,
)
from pagedinfer.engine.llm import LLM
from pagedinfer.engine.sample.sampler import SamplerOutput
from pagedinfer.engine.sampling_params import SamplingParams

PARAMS = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def runner(tiny_llama_dir):
    config = EngineConfig(
        model=str(tiny_llama_dir),
        cache=CacheConfig(block_size=4, num_blocks=64),
        scheduler=SchedulerConfig(max_model_len=128),
        device=DeviceConfig(device="cpu", dtype="float32"),
    )
    return LLM(config).core.runner


def _seq(seq_id: int, num_new: int, samples: bool, forks: int = 0) -> ScheduledSequence:
    row = SamplingRow(seq_id, PARAMS, None, 3, [1, 2], [4, 5, 6]) if samples else None
    fork_rows = tuple(SamplingRow(100 + seq_id + i, PARAMS, None, 0, [1, 2], []) for i in range(forks))
    return ScheduledSequence(seq_id, [7] * num_new, 10, 2, 0, row, fork_rows)


def _sched(seqs: list[ScheduledSequence]) -> SchedulerOutput:
    qsl = np.concatenate([[0], np.cumsum([s.num_new_tokens for s in seqs])]).astype(np.int32)
    b, t = len(seqs), int(qsl[-1])
    z = np.zeros
    layout = BatchLayout(z((b, 4), np.int32), z(t, np.int32), z(t, np.int32), z(b, np.int32), qsl)
    return SchedulerOutput(seqs, layout)


def test_decode_plan_equals_the_general_plan(runner):
    # A decode, a prompt chunk that does not sample yet, a prompt's last chunk.
    plain = [_seq(1, 1, True), _seq(2, 3, False), _seq(3, 4, True)]
    rows_idx, rows, groups = runner._sampling_plan(_sched(plain))
    assert rows_idx.dtype == np.int64 and rows_idx.tolist() == [0, 7]
    # A trailing sequence with a fork row sends the same batch down the general path.
    g_idx, g_rows, g_groups = runner._sampling_plan(_sched([*plain, _seq(4, 1, True, forks=1)]))
    assert g_idx.tolist()[:2] == rows_idx.tolist() and g_rows[:2] == rows
    assert [(g.seq_id, g.first_row, g.draft_token_ids) for g in g_groups[:2]] == [
        (g.seq_id, g.first_row, g.draft_token_ids) for g in groups
    ]


def test_collect_without_drafts_equals_the_verifier(runner):
    seqs = [_seq(1, 1, True), _seq(2, 3, False), _seq(3, 4, True, forks=2)]
    _, rows, groups = runner._sampling_plan(_sched(seqs))
    tokens = torch.tensor([5, 9, 11, 13])
    result = runner._collect(SamplerOutput(tokens), tokens.tolist(), rows, groups, [None] * len(rows))
    expected = runner.verifier.verify(tokens.tolist(), groups)
    assert [(s.seq_id, s.token_ids) for s in result.sampled] == [
        (g.seq_id, t) for g, t in zip(groups, expected, strict=True)
    ]
    assert [s.seq_id for s in result.sampled] == [1, 3, 103, 104]
    assert result.num_draft_tokens == 0 and result.num_accepted_tokens == 0
