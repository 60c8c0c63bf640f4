"""The tensor-parallel process group: one process per rank, gloo on the CPU, NCCL on CUDA.

Every collective has a timeout (`timeout_s`), so a rank that died mid-step fails the others'
collectives instead of hanging them (gloo: at once when the peer's socket closes; NCCL: when
its watchdog sees the timeout). Idle waits between steps are not collectives (workers wait on
their pipe, driver.py), so an idle engine never times out.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 300.0  # the slowest first step (kernel compilation) stays far below it


@dataclass(frozen=True)
class GroupAddress:
    """Where the ranks meet (rank 0's TCP store) and how many they are."""

    host: str
    port: int
    world_size: int
    timeout_s: float = DEFAULT_TIMEOUT_S


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


class TPGroup:
    """This process's membership: rank, size and the three collectives the model needs."""

    def __init__(self, address: GroupAddress, rank: int, device: torch.device) -> None:
        self.rank = rank
        self.world_size = address.world_size
        self.device = device
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(
            backend_for(device),
            init_method=f"tcp://{address.host}:{address.port}",
            rank=rank,
            world_size=address.world_size,
            timeout=datetime.timedelta(seconds=address.timeout_s),
            **kwargs,
        )

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of x over the ranks, in place (a row-parallel layer's partial outputs)."""
        dist.all_reduce(x)
        return x

    def all_gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, V_r] from every rank -> [N, tp * V_r], rank r's columns at r * V_r."""
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x on every rank (workers pass a buffer of the same shape and dtype)."""
        dist.broadcast(x, src=0)
        return x

    def min_int(self, value: int) -> int:
        """The smallest `value` over the ranks (KV blocks: every rank must fit the agreed count)."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
