"""A worker rank's process: join the group, load its shard, then execute what rank 0 sends.

Workers never schedule or sample: each message on the pipe (messages.py) is one model call
(a forward with the LM head at its sampled rows) whose tensors follow as one broadcast. The
pipe, not a collective, carries the wait between steps, so an idle engine never times out. Rank 0 gone (pipe closed) or any error: the worker
exits non-zero (rank 0 watches every worker and takes the engine down, driver.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import sys
from dataclasses import dataclass
from multiprocessing.connection import Client

import torch

from pagedinfer.engine.config import SERVER_LOG_FORMAT, EngineConfig
from pagedinfer.engine.models.loader import plan_model_load
from pagedinfer.engine.parallel.group import GroupAddress, TPGroup
from pagedinfer.engine.parallel.messages import ForwardCall, LogitsCall, SizeKVCall, StopCall, unpack_forward
from pagedinfer.engine.parallel.model import TensorParallelLlama
from pagedinfer.engine.parallel.rank import agree_num_blocks, load_rank_model, rank_device
from pagedinfer.kernels import ops

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs to start (pickled into the spawned process)."""

    config: EngineConfig
    address: GroupAddress
    rank: int
    device: str  # rank 0's device; this rank's is rank_device(device, rank)


@dataclass(frozen=True)
class WorkerLaunch:
    """What rank 0 writes to a worker's stdin: its spec and where to connect back."""

    spec: WorkerSpec
    address: tuple[str, int]
    authkey: bytes


class _Executor:
    """A worker's model, KV cache and the handler of each message kind."""

    def __init__(self, model: TensorParallelLlama) -> None:
        self.model = model
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []

    @torch.inference_mode()
    def handle(self, msg: object, config: EngineConfig) -> bool:
        """Run one message; False when the loop should end."""
        model, device = self.model, self.model.device
        if isinstance(msg, ForwardCall):
            payload = model.group.broadcast(torch.empty(msg.payload_size, dtype=torch.int64, device=device))
            inputs = unpack_forward(msg, payload)
            if inputs.block_copies is not None:
                ops.copy_blocks(
                    [k for k, _ in self.kv_caches], [v for _, v in self.kv_caches], inputs.block_copies
                )
            md = inputs.attn_metadata
            hidden = model(inputs.input_ids, inputs.positions, self.kv_caches, md)
            if msg.num_logit_rows:  # rank 0's own LM head at these rows gathers with this one
                model.compute_logits(hidden[md.logits_indices], upcast=False, backend=msg.backend)
        elif isinstance(msg, LogitsCall):
            hidden = torch.empty((msg.num_rows, model.config.hidden_size), dtype=model.dtype, device=device)
            model.compute_logits(model.group.broadcast(hidden), upcast=False, backend=msg.backend)
        elif isinstance(msg, SizeKVCall):
            from pagedinfer.engine.worker.kv_cache import allocate_kv_caches

            num_blocks = agree_num_blocks(model, config, msg.backend, companion=None)
            block_size = config.cache.block_size
            self.kv_caches = allocate_kv_caches(
                model.rank_config, num_blocks, block_size, device, model.dtype
            )
        elif isinstance(msg, StopCall):
            return False
        else:
            raise TypeError(f"unknown message {type(msg).__name__}")
        return True


def main() -> None:
    """`python -m pagedinfer.engine.parallel.worker`: the launch from stdin, then `run_worker`."""
    logging.basicConfig(level=logging.INFO, format=SERVER_LOG_FORMAT)
    launch: WorkerLaunch = pickle.loads(sys.stdin.buffer.read())
    conn = Client(launch.address, authkey=launch.authkey)
    conn.send(launch.spec.rank)
    run_worker(launch.spec, conn)


def run_worker(spec: WorkerSpec, conn) -> None:
    """Join the group, load this rank's shard, execute messages until StopCall."""
    if spec.device == "cpu":  # the ranks share the host's cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.address.world_size))
    device = rank_device(torch.device(spec.device), spec.rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    group = None
    try:
        group = TPGroup(spec.address, spec.rank, device)
        torch.manual_seed(spec.config.seed)
        plan = plan_model_load(spec.config.model, spec.config.revision)
        executor = _Executor(load_rank_model(spec.config, plan, group, device))
        conn.send(("loaded", os.getpid()))
        while True:
            try:
                msg = conn.recv()
            except EOFError:
                logger.error("rank %d: rank 0 is gone; exiting", spec.rank)
                os._exit(1)  # (a collective of a dead group would block the interpreter's exit)
            if not executor.handle(msg, spec.config):
                break
    except Exception as exc:
        logger.exception("tensor-parallel rank %d failed", spec.rank)
        with contextlib.suppress(OSError):  # rank 0 is gone: nobody to tell
            conn.send(("failed", f"rank {spec.rank}: {type(exc).__name__}: {exc}"))
        sys.stdout.flush()
        os._exit(1)
    if group is not None:
        group.close()


if __name__ == "__main__":  # run the module's own copy: pickled classes name it, not __main__
    from pagedinfer.engine.parallel.worker import main as worker_main

    worker_main()
