"""The matplotlib plumbing the bench scripts share: a headless figure, saved as PNG, then closed.

matplotlib is a dev dependency only; a bare GPU machine may lack it, and a benchmark that has
already written its JSON should then say so and go on instead of failing on its plot.

    drawn = plotting.subplots(path, 1, 2, figsize=(10, 4))
    if drawn is None:
        return
    fig, (ax1, ax2) = drawn
    ...
    plotting.save(fig, path, dpi=120)

Imported as a sibling (`import plotting`, bench/ on sys.path), as bench/speculative.py does.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def subplots(path: Path, *args: Any, **kwargs: Any) -> tuple[Figure, Any] | None:
    """`plt.subplots(*args, **kwargs)` on the Agg backend, or None (after a line) without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        print(f"matplotlib not installed: no plot {Path(path).name}")
        return None
    matplotlib.use("Agg")  # no display on a benchmark machine
    import matplotlib.pyplot as plt

    return plt.subplots(*args, **kwargs)


def save(fig: Figure, path: Path, dpi: int) -> None:
    """Lay out, write the PNG and close the figure (pyplot keeps every open figure alive)."""
    import matplotlib.pyplot as plt

    try:
        fig.tight_layout()
        fig.savefig(path, dpi=dpi)
    finally:
        plt.close(fig)
