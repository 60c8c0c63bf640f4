"""`pagedinfer serve` flags that pick how the server is put together (no server started)."""

from __future__ import annotations

import subprocess
import sys
import tempfile

import pytest
import torch

from pagedinfer.engine.cli import build_parser
from pagedinfer.engine.server.cli_args import (
    check_api_server_count,
    run_serve_command,
    server_config_from_args,
    wants_engine_process,
)


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


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["--api-server-count", "2", "--no-engine-process"], "needs the engine core in its own process"),
        (["--api-server-count", "0"], "--api-server-count must be >= 1"),
    ],
)
def test_bad_api_server_count_combinations_exit_with_a_message(argv, error):
    args = build_parser().parse_args(["serve", "--device", "cpu", *argv])
    with pytest.raises(SystemExit, match=error):
        run_serve_command(args)  # refused before anything is bound or loaded


@pytest.mark.parametrize(
    "argv", [[], ["--engine-process"], ["--api-server-count", "1", "--no-engine-process"]]
)
def test_api_server_count_defaults_to_one_and_allows_every_engine_mode(argv):
    args = build_parser().parse_args(["serve", "--device", "cpu", *argv])
    check_api_server_count(args)
    assert server_config_from_args(args).api_server_count == 1


def test_api_server_count_reaches_the_server_config():
    args = build_parser().parse_args(["serve", "--device", "cpu", "--api-server-count", "3"])
    check_api_server_count(args)  # the engine process is implied on the CPU too
    assert server_config_from_args(args).api_server_count == 3


def test_the_cli_refuses_several_api_servers_without_an_engine_process():
    argv = [sys.executable, "-m", "pagedinfer.engine.cli", "serve", "--device", "cpu"]
    argv += ["--api-server-count", "2", "--no-engine-process"]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=tempfile.gettempdir())
    assert result.returncode != 0 and "drop --no-engine-process" in result.stderr, result
