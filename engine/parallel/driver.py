"""Rank 0 of a tensor-parallel engine: the scheduler, the block manager and the sampler stay
single and unchanged here; every model call is mirrored to the workers first.

`start_tensor_parallel` validates the split (a clear error naming the numbers, before any
process starts), spawns ranks 1..tp-1, joins the process group and loads rank 0's shard while
the workers load theirs. `DriverModel` stands in for the model in the runner: each forward
sends one message (messages.py) and then runs rank 0's shard, whose collectives meet the
workers', including the LM head at the rows the step samples, which every rank runs right after
the forward; `DriverRunner` samples from those logits and adds the step's KV block copies to
the forward's message. Any other LM-head call (prompt logprobs) is a message of its own.
CUDA graphs are not captured under tensor parallelism (every rank would have to capture and
replay in lockstep): steps run eagerly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedinfer.engine.config import EngineConfig, ModelConfig
from pagedinfer.engine.models.loader import plan_model_load
from pagedinfer.engine.parallel.group import GroupAddress, TPGroup
from pagedinfer.engine.parallel.messages import LogitsCall, SizeKVCall, forward_call
from pagedinfer.engine.parallel.model import TensorParallelLlama
from pagedinfer.engine.parallel.plan import TensorParallelConfigError, check_tensor_parallel
from pagedinfer.engine.parallel.rank import agree_num_blocks, load_rank_model, rank_device
from pagedinfer.engine.parallel.worker import WorkerSpec
from pagedinfer.engine.parallel.workers import WorkerSet, free_port
from pagedinfer.engine.spec_decode.self_draft import SELF_PREFIX
from pagedinfer.engine.worker.attn_metadata import AttentionMetadata
from pagedinfer.engine.worker.kv_cache import CompanionPool
from pagedinfer.engine.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

LOAD_TIMEOUT_S = 3600.0  # a 70B shard from a slow disk


class DriverModel:
    """Rank 0's model as the runner sees it: the full model's config, device and dtype; each
    call goes to the workers (one message) and then to rank 0's shard."""

    def __init__(self, shard: TensorParallelLlama, workers: WorkerSet) -> None:
        self.shard = shard
        self.workers = workers
        self.config: ModelConfig = shard.config
        self._block_copies: torch.Tensor | None = None
        # The last forward's (hidden, logits_indices, logits at those rows in the GEMM's dtype).
        self._sampled: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @property
    def device(self) -> torch.device:
        return self.shard.device

    @property
    def dtype(self) -> torch.dtype:
        return self.shard.dtype

    def stage_block_copies(self, copies: torch.Tensor) -> None:
        """[C, 2] (src, dst) blocks the next forward's message carries (the runner applies them
        to rank 0's cache itself)."""
        self._block_copies = copies

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        header, payload = forward_call(input_ids, positions, attn_metadata, self._block_copies)
        self._block_copies = None
        self.workers.send(header)
        self.shard.group.broadcast(payload)
        hidden = self.shard(input_ids, positions, kv_caches, attn_metadata)
        indices = attn_metadata.logits_indices
        self._sampled = None
        if header.num_logit_rows:  # the workers run theirs now: the all-gather must meet them here
            logits = self.shard.compute_logits(hidden[indices], upcast=False, backend=header.backend)
            self._sampled = (hidden, indices, logits)
        return hidden

    def sampled_logits(
        self, hidden: torch.Tensor, logits_indices: torch.Tensor, upcast: bool
    ) -> torch.Tensor | None:
        """The logits of the forward that returned `hidden` at `logits_indices` (the very tensors),
        or None when they are not that forward's."""
        sampled, self._sampled = self._sampled, None
        if sampled is None or sampled[0] is not hidden or sampled[1] is not logits_indices:
            return None
        return sampled[2].float() if upcast else sampled[2]

    def compute_logits(
        self, hidden: torch.Tensor, upcast: bool = True, backend: str | None = None
    ) -> torch.Tensor:
        rows = hidden.contiguous()  # [N, hidden]
        self.workers.send(LogitsCall(int(rows.shape[0]), backend))
        self.shard.group.broadcast(rows)
        return self.shard.compute_logits(rows, upcast, backend)


class DriverRunner(ModelRunner):
    """The model runner of rank 0: the step's block copies ride along with its forward."""

    def launch_forward(self, sched, feed=None):
        if sched.block_copies and not sched.is_empty:
            copies = torch.tensor(sched.block_copies, dtype=torch.int64, device=self.config.device)
            self.model.stage_block_copies(copies)
        return super().launch_forward(sched, feed)

    def sampled_logits(self, hidden, logits_indices, upcast):
        logits = self.model.sampled_logits(hidden, logits_indices, upcast)
        if logits is None:  # (not the last forward's rows: the LM head as a message of its own)
            return super().sampled_logits(hidden, logits_indices, upcast)
        return logits

    # the workers run every call with rank 0: a step that fails midway cannot be resumed
    runs_in_lockstep = True

    def add_death_listener(self, callback: Callable[[str], None]) -> None:
        self.model.workers.add_death_listener(callback)

    def close(self) -> None:
        """Stop the workers and leave the process group (a later engine in this process may
        form another: torch.distributed allows one default group at a time)."""
        self.model.workers.close()
        self.model.shard.group.close()


@dataclass
class TensorParallelEngine:
    """What engine_builder assembles around: rank 0's model, tokenizer and KV agreement."""

    model: DriverModel
    tokenizer: object
    runner_class: type[ModelRunner] = DriverRunner

    @property
    def rank_config(self) -> ModelConfig:
        """Rank 0's modules' config: the KV cache holds its heads only."""
        return self.model.shard.rank_config

    def agree_num_blocks(self, config: EngineConfig, backend: str | None, companion: CompanionPool) -> int:
        """The KV block count every rank fits; every worker allocates it."""
        self.model.workers.send(SizeKVCall(backend))
        return agree_num_blocks(self.model.shard, config, backend, companion)


def start_tensor_parallel(
    config: EngineConfig, device: torch.device, on_phase: Callable[[str], None] = lambda phase: None
) -> TensorParallelEngine:
    """Validate, start the workers, load every rank's shard; raise before anything starts when
    the model cannot be split `config.tensor_parallel_size` ways."""
    tp = config.tensor_parallel_size
    spec = config.speculative
    if spec.method == "draft" and (spec.draft_model or "").startswith(SELF_PREFIX):
        raise TensorParallelConfigError(
            f"--speculative-model {spec.draft_model}: a layer subset of the target cannot draft under "
            "tensor parallelism; use n-gram speculation or a separate draft model"
        )
    if device.type == "cuda" and (device.index or 0) + tp > torch.cuda.device_count():
        raise TensorParallelConfigError(
            f"tensor parallel size {tp} from {device} needs {tp} GPUs; {torch.cuda.device_count()} visible"
        )
    plan = plan_model_load(config.model, config.revision)  # (downloads once, for every rank)
    try:
        check_tensor_parallel(plan.model_config, tp)
    except TensorParallelConfigError as exc:
        raise TensorParallelConfigError(f"{config.model}: {exc}") from None
    if config.device.enable_cuda_graphs and device.type == "cuda":
        logger.warning("tensor parallel size %d: CUDA graphs are not captured, steps run eagerly", tp)
    address = GroupAddress("127.0.0.1", free_port(), tp)
    specs = [WorkerSpec(config, address, rank, str(device)) for rank in range(1, tp)]
    workers = WorkerSet(specs)
    group = None
    try:
        group = TPGroup(address, 0, rank_device(device, 0))
        torch.manual_seed(config.seed)
        shard = load_rank_model(config, plan, group, device)
        workers.wait_loaded(LOAD_TIMEOUT_S)
    except BaseException:
        workers.close(timeout_s=5.0)
        if group is not None:
            group.close()
        raise
    logger.info("tensor parallel: %d ranks over %s (%s)", tp, device.type, group.device)
    return TensorParallelEngine(DriverModel(shard, workers), plan.tokenizer)
