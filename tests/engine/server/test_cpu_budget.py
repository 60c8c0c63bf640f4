"""The CPUs a process may use (affinity, cgroup v2 / v1 quota) and `--api-server-count auto`'s rule,
on cgroup files written to a tmp dir."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from pagedinfer.engine.server.cpu_budget import (
    CpuBudget,
    affinity_cpus,
    auto_api_server_count,
    quota_cpus,
    read_cpu_budget,
)


def _cgroup_v2(root: Path, cpu_max: str) -> Path:
    (root / "cpu.max").write_text(cpu_max + "\n")
    return root


def _cgroup_v1(root: Path, quota: str, period: str, folder: str = "cpu") -> Path:
    (root / folder).mkdir()
    (root / folder / "cpu.cfs_quota_us").write_text(quota + "\n")
    (root / folder / "cpu.cfs_period_us").write_text(period + "\n")
    return root


@pytest.mark.parametrize(
    ("num_affinity_cpus", "cpu_max", "num_cpus", "count"),
    [
        (16, "max 100000", 16, 4),  # no quota: the affinity mask decides
        (16, "200000 100000", 2, 1),  # quota 2 CPUs
        (16, "800000 100000", 8, 2),  # quota 8 CPUs
        (64, "max 100000", 64, 4),  # never more than 4
        (1, "max 100000", 1, 1),
        (16, "150000 100000", 1, 1),  # 1.5 CPUs round down
        (16, "50000 100000", 1, 1),  # half a CPU is still one
        (4, "1600000 100000", 4, 1),  # the affinity mask below the quota decides
        (12, "max 100000", 12, 3),
        (16, "garbage", 16, 4),  # malformed: the affinity mask alone
        (16, "-5 100000", 16, 4),
        (16, "400000 0", 16, 4),
        (16, "400000", 16, 4),
    ],
)
def test_auto_count_from_affinity_and_cgroup_v2_quota(tmp_path, num_affinity_cpus, cpu_max, num_cpus, count):
    budget = read_cpu_budget(_cgroup_v2(tmp_path, cpu_max), num_affinity_cpus=num_affinity_cpus)
    assert budget.num_cpus == num_cpus, budget
    assert auto_api_server_count(budget) == count


def test_a_malformed_cpu_max_is_logged_and_ignored(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="pagedinfer.server"):
        assert quota_cpus(_cgroup_v2(tmp_path, "lots 100000")) is None
    assert "cpu.max" in caplog.text and "lots 100000" in caplog.text


@pytest.mark.parametrize(
    ("quota", "period", "folder", "expected"),
    [
        ("400000", "100000", "cpu", 4),
        ("-1", "100000", "cpu", None),  # no quota
        ("250000", "100000", "cpu,cpuacct", 2),
        ("x", "100000", "cpu", None),
    ],
)
def test_cgroup_v1_quota(tmp_path, quota, period, folder, expected):
    assert quota_cpus(_cgroup_v1(tmp_path, quota, period, folder)) == expected


def test_cgroup_v2_wins_over_v1_files_and_no_files_mean_no_quota(tmp_path):
    assert quota_cpus(tmp_path) is None
    _cgroup_v1(tmp_path, "800000", "100000")
    assert quota_cpus(tmp_path) == 8
    _cgroup_v2(tmp_path, "200000 100000")
    assert quota_cpus(tmp_path) == 2


def test_affinity_is_this_process_s_mask():
    assert affinity_cpus() == len(os.sched_getaffinity(0))
    assert read_cpu_budget(Path("/nonexistent")).num_affinity_cpus == len(os.sched_getaffinity(0))


def test_describe_names_what_was_seen():
    assert CpuBudget(16).describe() == "16 CPUs usable: 16 in the affinity mask, no CPU quota"
    assert CpuBudget(16, 2).describe() == "2 CPUs usable: 16 in the affinity mask, CPU quota 2"
