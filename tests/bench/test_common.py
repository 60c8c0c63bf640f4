"""bench/common.py: the shared figure helper draws a PNG, and without matplotlib it says so instead
of raising (a bare GPU machine has written its JSON by then); the GPU scripts' command line."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def bench_import(monkeypatch):
    """Imports a bench sibling the way the scripts do (bench/ on sys.path), undone afterwards."""
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module


def test_subplots_then_save_writes_a_png_and_closes_the_figure(bench_import, tmp_path):
    common = bench_import("common")
    path = tmp_path / "fake.png"
    drawn = common.subplots(path, 1, 2, figsize=(4, 2))
    assert drawn is not None
    fig, (ax1, ax2) = drawn
    ax1.bar(["a", "b"], [1.0, 2.0])
    ax2.plot([1, 2, 3], [3, 1, 2])
    common.save(fig, path, dpi=50)

    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 1000
    import matplotlib
    import matplotlib.pyplot as plt

    assert matplotlib.get_backend().lower() == "agg"
    assert fig.number not in plt.get_fignums()


def test_without_matplotlib_subplots_logs_and_returns_none(bench_import, monkeypatch, tmp_path, capsys):
    common = bench_import("common")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    path = tmp_path / "fake.png"
    assert common.subplots(path, figsize=(4, 2)) is None
    assert "matplotlib not installed: no plot fake.png" in capsys.readouterr().out
    assert not path.exists()


def test_a_bench_plot_skips_without_matplotlib(bench_import, monkeypatch, tmp_path, capsys):
    # native_core.plot imported matplotlib unguarded once; now it skips.
    native_core = bench_import("native_core")
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    path = tmp_path / "native_core.png"
    native_core.plot({"op_mix": {}, "build_batch": []}, path)
    assert "no plot native_core.png" in capsys.readouterr().out
    assert not path.exists()


def test_gpu_parser_takes_out_and_rep_ms(bench_import, tmp_path):
    args = bench_import("common").gpu_parser("doc", rep_ms=25).parse_args(["--out", str(tmp_path)])
    assert args.out == tmp_path and args.rep_ms == 25
