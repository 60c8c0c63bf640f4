"""The `pagedinfer serve` flags (a contract with the operator and Helm charts) -> configs."""

from __future__ import annotations

import argparse
import logging
import sys
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
        "--speculative-ngram-match",
        choices=["folded", "exact"],
        default=SpeculativeConfig.ngram_match,
        help="ngram: where the ids match nowhere, also match tokens up to a leading space and letter "
        "case ('The' finds ' the'; the drafts stay the tokens that followed), or exact ids only",
    )
    eng.add_argument(
        "--speculative-device-chain",
        action=argparse.BooleanOptionalAction,
        default=SpeculativeConfig.device_chain,
        help="batches (greedy or sampled, without penalties, min_tokens or logprobs) accept and draft on the "
        "device (prompt lookup, or the draft model), so speculative steps are planned ahead with "
        "--async-scheduling (off: every speculative step is synchronous)",
    )
    eng.add_argument(
        "--speculative-device-chain-steps",
        type=int,
        default=SpeculativeConfig.device_chain_steps,
        help="chained ngram steps launched back to back per host pass (planned and applied as one)",
    )
    eng.add_argument(
        "--speculative-device-drafts",
        action=argparse.BooleanOptionalAction,
        default=SpeculativeConfig.device_drafts,
        help="draft model: drafts (greedy, or sampled without penalties) stay on the device and "
        "feed the verification there (off: the host reads each draft step's tokens)",
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
    srv.add_argument(
        "--loop",
        choices=["auto", "asyncio", "uvloop"],
        default="auto",
        help="event loop of the HTTP and gRPC servers (auto: uvloop where installed, else asyncio)",
    )
    srv.add_argument(
        "--gil-switch-interval-ms",
        type=float,
        default=None,
        help="sys.setswitchinterval for this process (Python's default: 5 ms); see apply_process_settings",
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
    if args.speculative_device_chain_steps < 1:
        raise SystemExit(
            f"--speculative-device-chain-steps must be >= 1, got {args.speculative_device_chain_steps}"
        )
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
        ngram_match=args.speculative_ngram_match,
        device_chain=args.speculative_device_chain,
        device_chain_steps=args.speculative_device_chain_steps,
        device_drafts=args.speculative_device_drafts,
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


def apply_process_settings(args: argparse.Namespace) -> None:
    """The GIL switch interval: the engine thread drops the GIL in every syscall and device wait
    (and in each wake-up of the event loop), and then waits up to one interval for the asyncio
    thread, busy encoding responses, to hand it back. Shorter means less engine stall per step."""
    if args.gil_switch_interval_ms is not None:
        if args.gil_switch_interval_ms <= 0:
            raise SystemExit("--gil-switch-interval-ms must be > 0")
        sys.setswitchinterval(args.gil_switch_interval_ms / 1000)


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
    apply_process_settings(args)
    if args.api_server_count > 1:
        from pagedinfer.engine.server.api_servers import run_api_servers

        switch_s = None if args.gil_switch_interval_ms is None else args.gil_switch_interval_ms / 1000
        config = engine_config_from_args(args)
        return run_api_servers(
            config, server_config_from_args(args), loop=args.loop, switch_interval_s=switch_s
        )
    loader = engine_process_loader if wants_engine_process(args) else default_loader
    return run_server(engine_config_from_args(args), server_config_from_args(args), loader, loop=args.loop)
