"""How many CPUs this process may use, and how many API servers (`--api-server-count auto`) they carry.

os.cpu_count() is the host's count; in a container the process may use fewer. Two limits count:
its affinity mask (a cpuset, Kubernetes' static CPU manager) and its CFS quota (a CPU limit:
cgroup v2's `cpu.max`, cgroup v1's `cpu.cfs_quota_us` / `cpu.cfs_period_us`). The budget is the
smaller of the two. Only the cgroup at `cgroup_root` is read: inside a container with a cgroup
namespace of its own (the default on cgroup v2) that is the container's cgroup; a quota set only
on a parent cgroup is not seen.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger("pagedinfer.server")
CGROUP_ROOT = Path("/sys/fs/cgroup")
# One API server per 4 CPUs, at most 4: each API server keeps about one core busy (one event
# loop), the engine core another, and tokenizer threads and the kernel need the rest. On a
# 16-CPU H200 host 4 API servers served 64 streams best (README, bench/NOTES.md).
CPUS_PER_API_SERVER = 4
MAX_AUTO_API_SERVERS = 4


@dataclass(frozen=True)
class CpuBudget:
    """The CPUs the affinity mask allows and the CFS quota in whole CPUs (None: no quota)."""

    num_affinity_cpus: int
    num_quota_cpus: int | None = None

    @property
    def num_cpus(self) -> int:
        if self.num_quota_cpus is None:
            return self.num_affinity_cpus
        return min(self.num_affinity_cpus, self.num_quota_cpus)

    def describe(self) -> str:
        quota = "no CPU quota" if self.num_quota_cpus is None else f"CPU quota {self.num_quota_cpus}"
        return f"{self.num_cpus} CPUs usable: {self.num_affinity_cpus} in the affinity mask, {quota}"


def read_cpu_budget(cgroup_root: Path = CGROUP_ROOT, num_affinity_cpus: int | None = None) -> CpuBudget:
    """This process's CPU budget; `num_affinity_cpus` (tests) replaces the affinity mask's count."""
    if num_affinity_cpus is None:
        num_affinity_cpus = affinity_cpus()
    return CpuBudget(num_affinity_cpus, quota_cpus(cgroup_root))


def affinity_cpus() -> int:
    """The CPUs this process may be scheduled on (os.cpu_count() where there is no affinity call)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def quota_cpus(cgroup_root: Path = CGROUP_ROOT) -> int | None:
    """The CFS quota in whole CPUs (rounded down, at least 1); None without a quota or when the
    files are missing or unreadable (a malformed file is logged and ignored)."""
    cpu_max = _read(cgroup_root / "cpu.max")  # cgroup v2: "QUOTA PERIOD" or "max PERIOD"
    if cpu_max is not None:
        fields = cpu_max.split()
        if len(fields) == 2 and fields[0] == "max":
            return None
        return _quota_to_cpus(cgroup_root / "cpu.max", fields)
    for folder in ("cpu", "cpu,cpuacct"):  # cgroup v1: quota -1 means none
        quota = _read(cgroup_root / folder / "cpu.cfs_quota_us")
        period = _read(cgroup_root / folder / "cpu.cfs_period_us")
        if quota is not None and period is not None:
            if quota.strip() == "-1":
                return None
            return _quota_to_cpus(cgroup_root / folder / "cpu.cfs_quota_us", [quota, period])
    return None


def auto_api_server_count(budget: CpuBudget) -> int:
    """clamp(cpus // CPUS_PER_API_SERVER, 1, MAX_AUTO_API_SERVERS), for an engine core in a process
    of its own (in-process, the answer is 1: the caller decides that)."""
    return max(1, min(MAX_AUTO_API_SERVERS, budget.num_cpus // CPUS_PER_API_SERVER))


def _quota_to_cpus(path: Path, fields: list[str]) -> int | None:
    try:
        quota, period = (int(f) for f in fields)
    except ValueError:
        quota = period = 0
    if len(fields) != 2 or quota <= 0 or period <= 0:
        logger.warning("ignoring %s: cannot read a CPU quota from %r", path, " ".join(fields))
        return None
    return max(1, quota // period)


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:  # absent (no such cgroup version) or not readable
        return None
