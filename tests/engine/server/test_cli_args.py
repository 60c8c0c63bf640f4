"""`pagedinfer serve` flags that pick how the server is put together (no server started)."""

from __future__ import annotations

import pytest
import torch

from pagedinfer.engine.cli import build_parser
from pagedinfer.engine.server.cli_args import wants_engine_process


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--device", "cpu"], False),
        (["--device", "cpu", "--engine-process"], True),
        (["--device", "cuda"], True),
        (["--device", "cuda:1", "--no-engine-process"], False),
        ([], torch.cuda.is_available()),  # auto: on exactly when serving on a GPU
    ],
)
def test_engine_process_is_on_for_gpu_serving_unless_told(argv, expected):
    args = build_parser().parse_args(["serve", *argv])
    assert wants_engine_process(args) is expected
