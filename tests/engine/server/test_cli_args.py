"""`pagedinfer serve` flags that pick how the server is put together (no server started)."""

from __future__ import annotations

import subprocess
import sys
import tempfile

import pytest
import torch

from pagedinfer.engine.cli import build_parser
from pagedinfer.engine.server.cli_args import (
    resolve_api_server_count,
    run_serve_command,
    server_config_from_args,
    wants_engine_process,
)
from pagedinfer.engine.server.cpu_budget import CpuBudget


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


def test_bad_api_server_count_combinations_exit_with_a_message():
    args = build_parser().parse_args(
        ["serve", "--device", "cpu", "--api-server-count", "2", "--no-engine-process"]
    )
    with pytest.raises(SystemExit, match="needs the engine core in its own process"):
        run_serve_command(args)  # refused before anything is bound or loaded


@pytest.mark.parametrize("value", ["0", "-1", "x", "1.5", "AUTO", ""])
def test_api_server_count_must_be_a_positive_int_or_auto(value, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve", "--api-server-count", value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --api-server-count: expected a positive integer or 'auto', got {value!r}" in err, err


@pytest.mark.parametrize(("value", "expected"), [([], "auto"), (["auto"], "auto"), (["1"], 1), (["7"], 7)])
def test_api_server_count_parses_auto_and_ints(value, expected):
    argv = ["serve", "--api-server-count", *value] if value else ["serve"]
    assert build_parser().parse_args(argv).api_server_count == expected


def _never_read() -> CpuBudget:
    raise AssertionError("the CPU budget is read only for auto with an engine process")


@pytest.mark.parametrize(
    ("argv", "budget", "expected"),
    [
        (["--device", "cpu"], _never_read, 1),  # the CPU default: the core runs in-process
        (["--device", "cuda", "--no-engine-process"], _never_read, 1),
        (["--device", "cuda"], lambda: CpuBudget(16), 4),  # the measured H200 host
        (["--device", "cuda"], lambda: CpuBudget(16, 2), 1),  # a 2-CPU limit
        (["--device", "cuda"], lambda: CpuBudget(16, 8), 2),
        (["--device", "cuda"], lambda: CpuBudget(256), 4),
        (["--device", "cpu", "--engine-process"], lambda: CpuBudget(12), 3),
        (["--device", "cuda", "--api-server-count", "3"], _never_read, 3),  # an int is kept
        (["--device", "cpu", "--api-server-count", "2"], _never_read, 2),  # engine process implied
        (["--device", "cuda", "--api-server-count", "1", "--no-engine-process"], _never_read, 1),
    ],
)
def test_auto_resolves_from_the_engine_mode_and_the_cpus(argv, budget, expected):
    args = build_parser().parse_args(["serve", *argv])
    assert resolve_api_server_count(args, read_cpus=budget) == expected


def test_auto_logs_what_it_resolved_to_and_why(caplog):
    with caplog.at_level("INFO", logger="pagedinfer.server"):
        resolve_api_server_count(build_parser().parse_args(["serve", "--device", "cpu"]))
        args = build_parser().parse_args(["serve", "--device", "cuda"])
        resolve_api_server_count(args, read_cpus=lambda: CpuBudget(16, 8))
    assert "--api-server-count auto: 1 (the engine core runs in this process)" in caplog.messages
    assert (
        "--api-server-count auto: 2 (engine core in its own process; "
        "8 CPUs usable: 16 in the affinity mask, CPU quota 8)"
    ) in caplog.messages


def test_server_config_gets_the_resolved_count():
    args = build_parser().parse_args(["serve", "--device", "cpu"])
    assert server_config_from_args(args).api_server_count == 1  # auto, engine in-process
    args = build_parser().parse_args(["serve", "--device", "cpu", "--api-server-count", "3"])
    assert server_config_from_args(args).api_server_count == 3


def test_the_cli_refuses_several_api_servers_without_an_engine_process():
    argv = [sys.executable, "-m", "pagedinfer.engine.cli", "serve", "--device", "cpu"]
    argv += ["--api-server-count", "2", "--no-engine-process"]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=tempfile.gettempdir())
    assert result.returncode != 0 and "drop --no-engine-process" in result.stderr, result


def _speculative(*argv: str):
    from pagedinfer.engine.server.cli_args import engine_config_from_args

    args = build_parser().parse_args(["serve", "--device", "cpu", "--speculative-method", "ngram", *argv])
    return engine_config_from_args(args).speculative


def test_speculation_chooses_its_strategy_without_a_speculative_config():
    from pagedinfer.engine.config import SpeculativeConfig

    spec = _speculative()
    assert spec == SpeculativeConfig(
        method="ngram"
    )  # the defaults: device chains of 4, device drafts, folded
    assert spec.device_chain and spec.device_drafts and spec.device_chain_steps == 4
    assert spec.ngram_match == "folded"


def test_speculative_config_overrides_the_internal_choices():
    text = '{"device_chain": false, "device_chain_steps": 2, "device_drafts": false, "ngram_match": "exact",'
    text += ' "ngram_min": 2, "ngram_max": 3, "max_batch_size": 8, "min_acceptance_rate": 0}'
    spec = _speculative("--speculative-config", text)
    assert (spec.device_chain, spec.device_chain_steps, spec.device_drafts) == (False, 2, False)
    assert (spec.ngram_match, spec.ngram_min, spec.ngram_max) == ("exact", 2, 3)
    assert (spec.max_batch_size, spec.min_acceptance_rate) == (8, 0)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"device_chian": false}', "unknown key 'device_chian' (known: ngram_match, "),
        ('{"num_speculative_tokens": 3}', "unknown key 'num_speculative_tokens'"),
        ('{"device_chain_steps": 0}', "device_chain_steps must be an integer >= 1, got 0"),
        ('{"device_chain_steps": true}', "device_chain_steps must be an integer >= 1, got true"),
        ('{"device_drafts": "no"}', 'device_drafts must be true or false, got "no"'),
        ('{"ngram_match": "fuzzy"}', 'ngram_match must be "folded" or "exact", got "fuzzy"'),
        ('{"min_acceptance_rate": 1.5}', "min_acceptance_rate must be a number from 0 to 1, got 1.5"),
        ('{"ngram_min": 5}', "ngram_min (5) must be <= ngram_max (4)"),
        ("[1]", "expected a JSON object"),
        ("{device_chain: 1}", "not JSON"),
    ],
)
def test_a_bad_speculative_config_is_a_startup_error_naming_the_key(text, message, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--speculative-method", "ngram", "--speculative-config", text])
    err = capsys.readouterr().err
    assert "argument --speculative-config:" in err
    assert message in err, err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--speculative-model", "builtin://smollm2-135m"], "only with --speculative-method draft"),
        (
            ["--speculative-method", "ngram", "--speculative-model", "x"],
            "only with --speculative-method draft",
        ),
        (["--speculative-method", "ngram", "--num-speculative-tokens", "0"], "must be >= 1, got 0"),
        (["--num-speculative-tokens", "-2"], "must be >= 1, got -2"),
        (["--speculative-config", '{"device_chain": false}'], "only with --speculative-method"),
        (["--speculative-method", "draft"], "needs --speculative-model"),
    ],
)
def test_speculative_flags_that_cannot_work_exit_at_startup(argv, message):
    """Refused before any model loads (not a server left running with /startup failed, nor a
    draft model silently ignored)."""
    from pagedinfer.engine.server.cli_args import engine_config_from_args

    args = build_parser().parse_args(["serve", "--device", "cpu", *argv])
    with pytest.raises(SystemExit, match=message):
        engine_config_from_args(args)
