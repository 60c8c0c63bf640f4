"""The `pagedinfer serve` flags (a contract with the operator and Helm charts) -> configs."""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Callable

from pagedinfer.engine.config import (
    DEFAULT_MODEL_URI,
    SERVER_LOG_FORMAT,
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    SchedulerConfig,
    ServerConfig,
    SpeculativeConfig,
)
from pagedinfer.engine.server.cpu_budget import CpuBudget, auto_api_server_count, read_cpu_budget

logger = logging.getLogger("pagedinfer.server")
AUTO = "auto"


def add_serve_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("serve", help="serve a model over HTTP (OpenAI API, WebSocket, page) and gRPC")
    p.add_argument(
        "--model", default=DEFAULT_MODEL_URI, help="folder, .gguf, builtin://smollm2-135m or hf://org/name"
    )
    p.add_argument("--served-model-name", default=None, help="name clients send as `model`")
    p.add_argument("--revision", default=None, help="hf:// revision")
    p.add_argument("--host", default=ServerConfig.host)
    p.add_argument("--http-port", type=int, default=ServerConfig.http_port)
    p.add_argument("--grpc-port", type=int, default=ServerConfig.grpc_port)
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--seed", type=int, default=0)
    eng = p.add_argument_group("engine")
    eng.add_argument("--block-size", type=int, default=CacheConfig.block_size)
    eng.add_argument("--max-num-seqs", type=int, default=SchedulerConfig.max_num_seqs)
    eng.add_argument("--max-num-batched-tokens", type=int, default=SchedulerConfig.max_num_batched_tokens)
    eng.add_argument("--max-model-len", type=int, default=None)
    eng.add_argument("--gpu-memory-utilization", type=float, default=CacheConfig.gpu_memory_utilization)
    eng.add_argument("--num-blocks", type=int, default=None)
    eng.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    eng.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="split the model over this many processes and GPUs (one process per rank; on the CPU "
        "the ranks share the host's cores): heads, MLP and vocabulary are sharded",
    )
    eng.add_argument("--speculative-method", choices=["ngram", "draft"], default=None)
    eng.add_argument(
        "--speculative-model", default=None, help="draft model URI (with --speculative-method draft)"
    )
    eng.add_argument("--num-speculative-tokens", type=int, default=SpeculativeConfig.num_speculative_tokens)
    eng.add_argument(
        "--speculative-config",
        type=speculative_config_arg,
        default=None,
        metavar="JSON",
        help="experts: a JSON object overriding speculation's internal choices, keys "
        + ", ".join(SPECULATIVE_CONFIG_KEYS)
        + " (docs/serving.md)",
    )
    eng.add_argument("--max-waiting-requests", type=int, default=SchedulerConfig.max_waiting_requests)
    eng.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    eng.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="plan and launch step N+1 while step N runs (default: on for CUDA, off on the CPU)",
    )
    srv = p.add_argument_group("server")
    srv.add_argument(
        "--api-key", default=None, help="require `Authorization: Bearer KEY` (or env PAGEDINFER_API_KEY)"
    )
    srv.add_argument(
        "--allowed-origins",
        default="",
        help="comma-separated WebSocket Origin allow-list beyond the same origin (default), * for any",
    )
    srv.add_argument(
        "--tool-call-parser",
        choices=["auto", "hermes", "llama3_json", "smollm2"],
        default="auto",
        help="the model's tool-call format (auto: chosen from the chat template)",
    )
    srv.add_argument(
        "--allow-unknown-fields",
        action="store_true",
        help="accept request fields the API does not define (logged) instead of answering 400",
    )
    srv.add_argument("--max-header-bytes", type=int, default=ServerConfig.max_header_bytes)
    srv.add_argument("--max-header-count", type=int, default=ServerConfig.max_header_count)
    srv.add_argument(
        "--drain-timeout", type=float, default=ServerConfig.drain_timeout_seconds, help="seconds"
    )
    srv.add_argument("--max-request-bytes", type=int, default=ServerConfig.max_request_bytes)
    srv.add_argument("--max-ws-message-bytes", type=int, default=ServerConfig.max_ws_message_bytes)
    srv.add_argument("--enable-vllm-metrics", action=argparse.BooleanOptionalAction, default=True)
    srv.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run the engine core (model, scheduler, detokenizer) in a process of its own "
        "(default: on when serving on a GPU, off on the CPU)",
    )
    srv.add_argument(
        "--api-server-count",
        type=api_server_count_arg,
        default=AUTO,
        metavar="N|auto",
        help="API-server processes (HTTP and gRPC) in front of one engine core, all on the same "
        "ports; > 1 runs the engine in its own process. auto (default): 1 when the engine core "
        "runs in-process (the CPU default, --no-engine-process), else one per 4 usable CPUs, 1 to 4",
    )
    p.set_defaults(func=run_serve_command)
    return p


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    if args.tensor_parallel_size < 1:
        raise SystemExit("--tensor-parallel-size must be >= 1")
    if args.speculative_method == "draft" and not args.speculative_model:
        raise SystemExit("--speculative-method draft needs --speculative-model")
    if args.speculative_model and args.speculative_method != "draft":
        raise SystemExit("--speculative-model is used only with --speculative-method draft")
    if args.num_speculative_tokens < 1:
        raise SystemExit(f"--num-speculative-tokens must be >= 1, got {args.num_speculative_tokens}")
    if args.speculative_config and args.speculative_method is None:
        raise SystemExit("--speculative-config is used only with --speculative-method")
    cache = CacheConfig(
        block_size=args.block_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        num_blocks=args.num_blocks,
        enable_prefix_caching=args.enable_prefix_caching,
    )
    scheduler = SchedulerConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        max_waiting_requests=args.max_waiting_requests,
        async_scheduling=args.async_scheduling,
    )
    speculative = SpeculativeConfig(
        method=args.speculative_method,
        num_speculative_tokens=args.num_speculative_tokens,
        draft_model=args.speculative_model,
        **(args.speculative_config or {}),
    )
    device = DeviceConfig(device=args.device, dtype=args.dtype, enable_cuda_graphs=not args.enforce_eager)
    config = EngineConfig(
        model=args.model,
        served_model_name=args.served_model_name,
        revision=args.revision,
        seed=args.seed,
        tensor_parallel_size=args.tensor_parallel_size,
        cache=cache,
        scheduler=scheduler,
        speculative=speculative,
        device=device,
    )
    return config


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    origins = tuple(o.strip() for o in args.allowed_origins.split(",") if o.strip())
    return ServerConfig(
        host=args.host,
        http_port=args.http_port,
        grpc_port=args.grpc_port,
        api_key=args.api_key or ServerConfig.api_key_from_env(),
        allowed_origins=origins,
        allow_unknown_fields=args.allow_unknown_fields,
        tool_call_parser=args.tool_call_parser,
        max_header_bytes=args.max_header_bytes,
        max_header_count=args.max_header_count,
        max_ws_message_bytes=args.max_ws_message_bytes,
        max_request_bytes=args.max_request_bytes,
        drain_timeout_seconds=args.drain_timeout,
        enable_vllm_metrics=args.enable_vllm_metrics,
        api_server_count=resolve_api_server_count(args),  # an int passes through
    )


def wants_engine_process(args: argparse.Namespace) -> bool:
    """--engine-process/--no-engine-process, else on for GPU serving: with GPU-short steps the
    server's per-token work on the engine's GIL cost 13-27% of the tokens/s at 16-64 streams
    on the H200 (bench/NOTES.md, Serving); on the CPU the step is long and the spawn is not."""
    if args.engine_process is not None:
        return bool(args.engine_process)
    if args.device == "cpu":
        return False
    import torch

    return args.device.startswith("cuda") or torch.cuda.is_available()


# --speculative-config: SpeculativeConfig's fields that speculation otherwise chooses itself (the
# ones with a flag of their own stay flags), each with its check. Unknown keys are refused.
def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_fraction(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= 1


SPECULATIVE_CONFIG_KEYS: dict[str, tuple[Callable[[object], bool], str]] = {
    "ngram_match": (lambda v: v in ("folded", "exact"), '"folded" or "exact"'),
    "ngram_min": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "ngram_max": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "device_chain": (lambda v: isinstance(v, bool), "true or false"),
    "device_chain_steps": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "device_drafts": (lambda v: isinstance(v, bool), "true or false"),
    "max_batch_size": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "min_acceptance_rate": (_is_fraction, "a number from 0 to 1"),
}


def speculative_config_arg(text: str) -> dict[str, object]:
    """argparse type of --speculative-config: a JSON object of SPECULATIVE_CONFIG_KEYS, each
    value checked; the first bad key is named."""
    try:
        overrides = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc}): {text!r}") from exc
    if not isinstance(overrides, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    for key, value in overrides.items():
        if key not in SPECULATIVE_CONFIG_KEYS:
            known = ", ".join(SPECULATIVE_CONFIG_KEYS)
            raise argparse.ArgumentTypeError(f"unknown key {key!r} (known: {known})")
        is_valid, expected = SPECULATIVE_CONFIG_KEYS[key]
        if not is_valid(value):
            raise argparse.ArgumentTypeError(f"{key} must be {expected}, got {json.dumps(value)}")
    low = overrides.get("ngram_min", SpeculativeConfig.ngram_min)
    high = overrides.get("ngram_max", SpeculativeConfig.ngram_max)
    if low > high:
        raise argparse.ArgumentTypeError(f"ngram_min ({low}) must be <= ngram_max ({high})")
    return overrides


def api_server_count_arg(text: str) -> int | str:
    """argparse type of --api-server-count: a positive int or "auto"."""
    if text == AUTO:
        return AUTO
    try:
        count = int(text)
    except ValueError:
        count = 0
    if count < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'auto', got {text!r}")
    return count


def resolve_api_server_count(
    args: argparse.Namespace, read_cpus: Callable[[], CpuBudget] = read_cpu_budget
) -> int:
    """--api-server-count as an int. N > 1 puts N processes in front of one core in a process of
    its own, so it is refused with --no-engine-process. auto: 1 when the core runs in-process
    (nothing to put in front of), else auto_api_server_count of the CPUs this process may use."""
    count = args.api_server_count
    if count != AUTO:
        if count < 1:  # argparse checks it; a Namespace built by hand may not
            raise SystemExit("--api-server-count must be >= 1")
        if count > 1 and args.engine_process is False:
            raise SystemExit(
                "--api-server-count > 1 needs the engine core in its own process: drop --no-engine-process"
            )
        return count
    if not wants_engine_process(args):
        logger.info("--api-server-count auto: 1 (the engine core runs in this process)")
        return 1
    budget = read_cpus()
    count = auto_api_server_count(budget)
    logger.info("--api-server-count auto: %d (engine core in its own process; %s)", count, budget.describe())
    return count


def run_serve_command(args: argparse.Namespace) -> int:
    from pagedinfer.engine.server.engine_handle import default_loader, engine_process_loader
    from pagedinfer.engine.server.serve import run_server  # heavy imports only when serving

    logging.basicConfig(level=logging.INFO, format=SERVER_LOG_FORMAT)  # before auto's line is logged
    # Resolved once: every later reader (server config, launcher) sees the int.
    args = argparse.Namespace(**{**vars(args), "api_server_count": resolve_api_server_count(args)})
    if args.api_server_count > 1:
        from pagedinfer.engine.server.api_servers import run_api_servers

        return run_api_servers(engine_config_from_args(args), server_config_from_args(args))
    loader = engine_process_loader if wants_engine_process(args) else default_loader
    return run_server(engine_config_from_args(args), server_config_from_args(args), loader)
