"""ModelRunner's sampling plan for steps with drafts (no forks) against its general path."""

from __future__ import annotations

import numpy as np
import pytest

from pagedinfer.engine.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig
from pagedinfer.engine.core.scheduler_output import (
    BatchLayout,
    SamplingRow,
    ScheduledSequence,
    SchedulerOutput,
)
from pagedinfer.engine.llm import LLM
from pagedinfer.engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def runner(tiny_llama_dir):
    config = EngineConfig(
        model=str(tiny_llama_dir),
        cache=CacheConfig(block_size=4, num_blocks=64),
        scheduler=SchedulerConfig(max_model_len=128),
        device=DeviceConfig(device="cpu", dtype="float32"),
    )
    return LLM(config).core.runner


def _seq(
    seq_id: int, num_new: int, num_spec: int, params: SamplingParams, forks: int = 0
) -> ScheduledSequence:
    row = SamplingRow(seq_id, params, 7, 3, [1, 2], [4, 5, 6, 99]) if num_new > num_spec or forks else None
    fork_rows = tuple(SamplingRow(100 + seq_id + i, params, None, 0, [1, 2], []) for i in range(forks))
    token_ids = [10 * seq_id + i for i in range(num_new)]
    return ScheduledSequence(seq_id, token_ids, 10, 2, num_spec, row, fork_rows)


def _sched(seqs: list[ScheduledSequence]) -> SchedulerOutput:
    qsl = np.concatenate([[0], np.cumsum([s.num_new_tokens for s in seqs])]).astype(np.int32)
    b, t = len(seqs), int(qsl[-1])
    z = np.zeros
    layout = BatchLayout(z((b, 4), np.int32), z(t, np.int32), z(t, np.int32), z(b, np.int32), qsl)
    return SchedulerOutput(seqs, layout)


def _fields(row: SamplingRow, with_outputs: bool) -> tuple:
    head = (row.seq_id, row.sampling_params, row.seed, row.output_position, row.prompt_token_ids)
    return (*head, row.output_token_ids[: row.output_position]) if with_outputs else head


@pytest.mark.parametrize("penalty", [False, True])
def test_spec_plan_equals_the_general_plan(runner, penalty):
    params = SamplingParams(temperature=0.0, repetition_penalty=1.3 if penalty else 1.0)
    # Drafts of different lengths, a plain decode, a prompt chunk that does not sample.
    seqs = [_seq(1, 5, 4, params), _seq(2, 1, 0, params), _seq(3, 3, 0, params), _seq(4, 3, 2, params)]
    seqs[2].sample = None
    idx, rows, groups = runner._sampling_plan(_sched(seqs))
    # A trailing sequence with a fork row sends the same batch down the general path.
    g_idx, g_rows, g_groups = runner._sampling_plan(_sched([*seqs, _seq(5, 1, 0, params, forks=1)]))
    assert idx.dtype == np.int64 and idx.tolist() == g_idx.tolist()[: len(idx)] == [
        0,
        1,
        2,
        3,
        4,
        5,
        9,
        10,
        11,
    ]
    assert [(g.seq_id, g.first_row, g.draft_token_ids) for g in groups] == [
        (g.seq_id, g.first_row, g.draft_token_ids) for g in g_groups[: len(groups)]
    ]
    assert groups[0].draft_token_ids == [11, 12, 13, 14] and groups[2].draft_token_ids == [41, 42]
    # Penalty histories (outputs before the row + the drafts before it) only when a row reads them.
    assert [_fields(r, penalty) for r in rows] == [_fields(r, penalty) for r in g_rows[: len(rows)]]
    assert [r.output_position for r in rows] == [3, 4, 5, 6, 7, 3, 3, 4, 5]
