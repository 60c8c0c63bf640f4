"""Session setup for every test area.

`python -m pytest` (scripts/test.sh, bench/run_gpu.sh) puts the repository root first on
sys.path. There the source folder kernels/ (installed as pagedinfer.kernels) would shadow Hugging
Face's `kernels` package, which transformers 5.2x requires and imports: `from kernels import
CUDAProperties` then fails inside every transformers model. The root moves to the end of the
path: installed packages win, and `tests.*` helpers still import from it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parents[1])
_AT_ROOT = [p for p in sys.path if os.path.abspath(p or os.curdir) == _ROOT]
if _AT_ROOT:
    sys.path[:] = [p for p in sys.path if p not in _AT_ROOT] + [_ROOT]
