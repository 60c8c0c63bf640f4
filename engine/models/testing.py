"""A tiny paged driver for tests and examples: block manager + KV cache + model, greedy decoding.

Not the engine (that is engine_core/scheduler/model_runner): no preemption, no sampling beyond
argmax, no token budget beyond an optional chunk size. It exists so model correctness can be
tested through the real paged path: the block manager's slot mapping and block tables, the
cache writes, copy-on-write and prefix-cache hits.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from pagedinfer.engine.models.llama import LlamaForCausalLM
from pagedinfer.engine.worker.attn_metadata import AttentionMetadata
from pagedinfer.engine.worker.kv_cache import allocate_kv_caches
from pagedinfer.kernels import ops


class PagedRunner:
    """Drives one model over a block manager (native `BlockManager` or the Python reference).

    Per sequence it tracks the tokens and how many of them are computed (their K/V in the cache).
    """

    def __init__(self, model: LlamaForCausalLM, block_manager: Any, num_blocks: int, block_size: int) -> None:
        self.model = model
        self.blocks = block_manager
        self.kv_caches = allocate_kv_caches(model.config, num_blocks, block_size, model.device, model.dtype)
        self.tokens: dict[int, list[int]] = {}
        self.num_computed: dict[int, int] = {}
        self.backend: str | None = None  # attention backend for every step (None: auto)

    def add(self, seq_id: int, token_ids: Sequence[int]) -> int:
        """Register a prompt; returns how many leading tokens were prefix-cache hits."""
        num_cached = int(self.blocks.add_sequence(seq_id, np.asarray(token_ids, dtype=np.int32)))
        self.tokens[seq_id] = list(token_ids)
        # A full hit still recomputes the last token: its logits are what the next step samples from.
        self.num_computed[seq_id] = min(num_cached, len(token_ids) - 1)
        return num_cached

    def append(self, seq_id: int, token_id: int) -> None:
        copies = self.blocks.append_tokens(seq_id, np.asarray([token_id], dtype=np.int32))
        if len(copies):
            block_copies = torch.as_tensor(
                np.asarray(copies, dtype=np.int64).reshape(-1, 2), device=self.model.device
            )
            ops.copy_blocks([k for k, _ in self.kv_caches], [v for _, v in self.kv_caches], block_copies)
        self.tokens[seq_id].append(token_id)

    def free(self, seq_id: int) -> None:
        self.blocks.free(seq_id)
        del self.tokens[seq_id], self.num_computed[seq_id]

    @torch.inference_mode()
    def step(self, seq_ids: Sequence[int], num_new: Sequence[int]) -> torch.Tensor:
        """One forward over `num_new[i]` uncomputed tokens of each sequence -> logits [T, vocab] fp32."""
        computed = [self.num_computed[s] for s in seq_ids]
        batch = self.blocks.build_batch(
            np.asarray(seq_ids, dtype=np.int64),
            np.asarray(computed, dtype=np.int32),
            np.asarray(num_new, dtype=np.int32),
        )
        input_ids = np.concatenate(
            [self.tokens[s][c : c + n] for s, c, n in zip(seq_ids, computed, num_new, strict=True)]
        )
        device = self.model.device
        md = AttentionMetadata.from_batch(
            batch, device, logits_indices=np.arange(len(input_ids)), backend=self.backend
        )
        ids = torch.as_tensor(input_ids, dtype=torch.int64, device=device)
        hidden = self.model(ids, md.positions, self.kv_caches, md)  # [T, hidden]
        logits = self.model.compute_logits(hidden[md.logits_indices])  # [T, vocab]
        for s, n in zip(seq_ids, num_new, strict=True):
            self.num_computed[s] += n
        self.blocks.mark_computed(
            np.asarray(seq_ids, dtype=np.int64),
            np.asarray([self.num_computed[s] for s in seq_ids], dtype=np.int32),
        )
        return logits

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        stop_token_ids: Sequence[int] = (),
        chunk_size: int | None = None,
    ) -> list[list[int]]:
        """Greedy continuations of all prompts, batched; prefills split into `chunk_size` pieces."""
        seq_ids = list(range(len(prompts)))
        for seq_id, prompt in zip(seq_ids, prompts, strict=True):
            self.add(seq_id, prompt)
        outputs: dict[int, list[int]] = {s: [] for s in seq_ids}
        running = list(seq_ids)
        while running:
            pending = [len(self.tokens[s]) - self.num_computed[s] for s in running]
            num_new = [p if chunk_size is None else min(p, chunk_size) for p in pending]
            logits = self.step(running, num_new)
            last_rows = np.cumsum(num_new) - 1
            next_ids = logits[torch.as_tensor(last_rows)].argmax(dim=-1).tolist()
            for s, n, p, token in zip(list(running), num_new, pending, next_ids, strict=True):
                if n < p:
                    continue  # mid-prefill chunk: nothing to sample yet
                outputs[s].append(token)
                if len(outputs[s]) >= max_new_tokens or token in stop_token_ids:
                    running.remove(s)
                else:
                    self.append(s, token)
        for s in seq_ids:
            self.free(s)
        return [outputs[s] for s in seq_ids]
