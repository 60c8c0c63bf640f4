"""Shared fixtures of the operator tests."""

from __future__ import annotations

import sys
from pathlib import Path

# Helpers next to the tests (operator_crd_tools.py, operator_render_tools.py) import as plain modules under --import-mode=importlib.
sys.path.insert(0, str(Path(__file__).parent))
