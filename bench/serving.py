"""Serving benchmark: N concurrent streaming clients (gRPC and OpenAI HTTP/SSE) against a real
`pagedinfer serve` on loopback, sweeping N; then the same workload on the offline AsyncEngine
in-process (no server) as the peer. Reports TTFT and ITL p50/p99 (client-side), output
tokens/s, and the serving overhead ratio: server tokens/s / offline tokens/s (target >= 0.95).

    .venv/bin/python bench/serving.py                      # CPU, SmolLM2, N = 1,2,4,8
    python3 bench/serving.py --model hf://... --device cuda --concurrency 1,8,32,128 --max-tokens 128

Each client runs a closed loop of --requests-per-client requests (prompt of --prompt-len token
ids, greedy, ignore_eos, exactly --max-tokens output tokens). The server and the offline engine
are both alive, and --rounds interleave the three modes at each N (a shared machine's noise
hits all alike). Writes JSON + PNG + a summary to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx


@dataclass
class RequestResult:
    ttft: float  # send -> first token, seconds
    itls: list[float]  # gaps between token-carrying messages, per token
    num_tokens: int


@dataclass
class LevelResult:
    mode: str  # "grpc" | "http" | "offline"
    concurrency: int
    num_requests: int
    wall_seconds: float
    output_tokens: int
    tokens_per_second: float
    ttft_p50: float
    ttft_p99: float
    itl_p50: float
    itl_p99: float
    ratio_vs_offline: float | None = None


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def summarize(mode: str, n: int, results: list[RequestResult], wall: float) -> LevelResult:
    tokens = sum(r.num_tokens for r in results)
    itls = [x for r in results for x in r.itls]
    ttfts = [r.ttft for r in results]
    return LevelResult(
        mode,
        n,
        len(results),
        wall,
        tokens,
        tokens / wall,
        _pct(ttfts, 0.5),
        _pct(ttfts, 0.99),
        _pct(itls, 0.5),
        _pct(itls, 0.99),
    )


class _Timer:
    """Client-side token timing of one streamed request."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.last: float | None = None
        self.ttft = float("nan")
        self.itls: list[float] = []
        self.num_tokens = 0

    def tokens(self, k: int) -> None:
        if k <= 0:
            return
        now = time.perf_counter()
        if self.last is None:
            self.ttft = now - self.start
        else:
            self.itls.extend([(now - self.last) / k] * k)
        self.last = now
        self.num_tokens += k

    def result(self) -> RequestResult:
        return RequestResult(self.ttft, self.itls, self.num_tokens)


# ---- clients ----------------------------------------------------------------------------------
async def http_request(
    client: httpx.AsyncClient, url: str, prompt_ids: list[int], max_tokens: int
) -> RequestResult:
    body = {
        "prompt": prompt_ids,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    body["stream_options"] = {"include_usage": True}
    timer = _Timer()
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"]:
                timer.tokens(1)  # one SSE chunk per engine output (one step) of this request
            elif chunk.get("usage"):
                timer.num_tokens = chunk["usage"]["completion_tokens"]  # exact count for tokens/s
    return timer.result()


async def grpc_request(stub, pb, prompt_ids: list[int], max_tokens: int) -> RequestResult:
    sampling = pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    request = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=prompt_ids), sampling=sampling)
    timer = _Timer()
    async for response in stub.Generate(request):
        timer.tokens(sum(len(d.token_ids) for d in response.deltas))
    return timer.result()


async def offline_request(engine, params, prompt_ids: list[int]) -> RequestResult:
    timer = _Timer()
    async for out in engine.generate(prompt_token_ids=prompt_ids, sampling_params=params):
        timer.tokens(sum(len(d.token_ids) for d in out.deltas))
    return timer.result()


async def run_level(n: int, per_client: int, one_request) -> tuple[list[RequestResult], float]:
    async def client(i: int) -> list[RequestResult]:
        return [await one_request(i * per_client + j) for j in range(per_client)]

    start = time.perf_counter()
    groups = await asyncio.gather(*(client(i) for i in range(n)))
    return [r for g in groups for r in g], time.perf_counter() - start


def prompts(count: int, length: int, vocab: int) -> list[list[int]]:
    """Distinct prompts (no prefix-cache sharing between requests): deterministic token ids."""
    return [[(1000 + 7919 * i + 104729 * j) % (vocab - 10) + 5 for j in range(length)] for i in range(count)]


# ---- a random model (the GPU machine has no network and no embedded model) -------------------
RANDOM_SHAPES = {  # Llama bodies with a byte-level vocabulary (256 bytes + 2 specials)
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
    "llama-1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
    ),
    "llama-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
    ),
}


def write_random_llama(folder: Path, shape: str, seed: int = 0) -> Path:
    """A random Llama checkpoint (HF layout: config.json, model.safetensors, tokenizer.json)."""
    import torch
    from safetensors.torch import save_file
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    cfg = {**RANDOM_SHAPES[shape], "vocab_size": 258, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5}
    cfg |= {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "rope_theta": 500000.0}
    cfg |= {"bos_token_id": 256, "eos_token_id": 257, "tie_word_embeddings": True, "torch_dtype": "bfloat16"}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<|im_start|>", special=True), AddedToken("<|im_end|>", special=True)])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"})
    )
    g = torch.Generator().manual_seed(seed)
    h, inter, n_layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    head_dim = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * head_dim

    def w(*shape_: int) -> torch.Tensor:
        return (torch.randn(*shape_, generator=g) * shape_[-1] ** -0.5).to(torch.bfloat16)

    tensors = {
        "model.embed_tokens.weight": w(258, h),
        "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
    }
    for i in range(n_layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "self_attn.q_proj.weight": w(h, h),
            p + "self_attn.k_proj.weight": w(kv, h),
            p + "self_attn.v_proj.weight": w(kv, h),
            p + "self_attn.o_proj.weight": w(h, h),
            p + "mlp.gate_proj.weight": w(inter, h),
            p + "mlp.up_proj.weight": w(inter, h),
            p + "mlp.down_proj.weight": w(h, inter),
            p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
        }
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


# ---- server process ---------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    args: list[str]
    http_port: int = field(default_factory=_free_port)
    grpc_port: int = field(default_factory=_free_port)
    proc: subprocess.Popen | None = None

    def start(self, timeout: float = 600) -> Server:
        argv = [sys.executable, "-m", "pagedinfer.engine.cli", "serve", "--host", "127.0.0.1"]
        argv += ["--http-port", str(self.http_port), "--grpc-port", str(self.grpc_port), *self.args]
        self.log = tempfile.NamedTemporaryFile("w+", prefix="bench-serve-", suffix=".log", delete=False)  # noqa: SIM115
        self.proc = subprocess.Popen(
            argv, stdout=self.log, stderr=subprocess.STDOUT, cwd=tempfile.gettempdir()
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {Path(self.log.name).read_text()[-3000:]}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.http_port}/ready", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError("server not ready")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(120)


# ---- the sweep --------------------------------------------------------------------------------
async def _offline_engine(args):
    from pagedinfer.engine.async_engine import AsyncEngine
    from pagedinfer.engine.server.cli_args import add_serve_parser, engine_config_from_args

    parser = argparse.ArgumentParser()
    ns = add_serve_parser(parser.add_subparsers()).parse_args(server_args(args))
    if args.torch_threads:
        import torch

        torch.set_num_threads(args.torch_threads)
    engine = AsyncEngine.from_config(engine_config_from_args(ns))
    await engine.wait_ready()
    return engine


async def sweep(server: Server, args, vocab: int) -> list[LevelResult]:
    """Rounds interleave the modes (offline, gRPC, HTTP) at each N, so a noisy neighbour hits all
    of them alike; tokens/s is the median over rounds, latencies pool every request."""
    import grpc

    from pagedinfer.engine.sampling_params import SamplingParams
    from pagedinfer.engine.server.proto_gen import inference_pb2 as pb
    from pagedinfer.engine.server.proto_gen import inference_pb2_grpc as pb_grpc

    url = f"http://127.0.0.1:{server.http_port}"
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    engine = None if args.no_offline else await _offline_engine(args)
    limits = httpx.Limits(
        max_connections=max(args.levels) + 4, max_keepalive_connections=max(args.levels) + 4
    )
    async with (
        httpx.AsyncClient(timeout=None, limits=limits) as client,
        grpc.aio.insecure_channel(f"127.0.0.1:{server.grpc_port}") as ch,
    ):
        stub = pb_grpc.InferenceServiceStub(ch)
        one = {
            "http": lambda ids: http_request(client, url, ids, args.max_tokens),
            "grpc": lambda ids: grpc_request(stub, pb, ids, args.max_tokens),
            "offline": lambda ids: offline_request(engine, params, ids),
        }
        modes = (["offline"] if engine is not None else []) + args.protocols
        warm = prompts(1, args.prompt_len, vocab)[0]
        for mode in modes:
            await one[mode](warm)
        out = []
        try:
            for n in args.levels:
                ps = prompts(n * args.requests_per_client, args.prompt_len, vocab)
                rounds: dict[str, list] = {m: [] for m in modes}
                for r in range(args.rounds):
                    for mode in modes[r % len(modes) :] + modes[: r % len(modes)]:  # rotate the order
                        rounds[mode].append(
                            await run_level(
                                n, args.requests_per_client, lambda k, f=one[mode], ps=ps: f(ps[k])
                            )
                        )
                for mode in modes:
                    out.append(summarize_rounds(mode, n, rounds[mode]))
                    print(_fmt(out[-1]), flush=True)
        finally:
            if engine is not None:
                await engine.shutdown(0)
    offline = {r.concurrency: r.tokens_per_second for r in out if r.mode == "offline"}
    for r in out:
        if r.mode != "offline" and r.concurrency in offline:
            r.ratio_vs_offline = r.tokens_per_second / offline[r.concurrency]
    return out


def summarize_rounds(mode: str, n: int, rounds: list[tuple[list[RequestResult], float]]) -> LevelResult:
    pooled = summarize(mode, n, [x for results, _ in rounds for x in results], sum(w for _, w in rounds))
    per_round = sorted(sum(x.num_tokens for x in results) / wall for results, wall in rounds)
    pooled.tokens_per_second = per_round[len(per_round) // 2]
    return pooled


def _fmt(r: LevelResult) -> str:
    ratio = f" ratio_vs_offline={r.ratio_vs_offline:.3f}" if r.ratio_vs_offline is not None else ""
    return (
        f"{r.mode:7s} N={r.concurrency:<4d} reqs={r.num_requests:<4d} tok/s={r.tokens_per_second:8.2f} "
        f"TTFT p50/p99={r.ttft_p50 * 1e3:8.1f}/{r.ttft_p99 * 1e3:8.1f} ms ITL p50/p99={r.itl_p50 * 1e3:7.1f}/{r.itl_p99 * 1e3:7.1f} ms{ratio}"
    )


def server_args(args) -> list[str]:
    """Flags for the server and (parsed by the same parser) the in-process offline engine."""
    base = ["--model", args.model, "--device", args.device, "--max-num-seqs", str(max(args.levels))]
    if args.device.startswith("cuda"):  # both engines live at once (interleaved rounds): half each
        base += ["--gpu-memory-utilization", "0.42"]
    if args.max_model_len:
        base += ["--max-model-len", str(args.max_model_len)]
    return base + args.server_arg


def plot(results: list[LevelResult], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for mode in ("offline", "grpc", "http"):
        rows = [r for r in results if r.mode == mode]
        if not rows:
            continue
        ns = [r.concurrency for r in rows]
        ax1.plot(ns, [r.tokens_per_second for r in rows], marker="o", label=mode)
        if mode != "offline":
            ax2.plot(ns, [r.ttft_p50 * 1e3 for r in rows], marker="o", label=f"{mode} TTFT p50")
            ax2.plot(ns, [r.itl_p50 * 1e3 for r in rows], marker="x", linestyle="--", label=f"{mode} ITL p50")
    ax1.set(xscale="log", xlabel="concurrent clients", ylabel="output tokens/s", title="throughput")
    ax2.set(
        xscale="log", yscale="log", xlabel="concurrent clients", ylabel="ms", title="latency (client side)"
    )
    for ax in (ax1, ax2):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="builtin://smollm2-135m")
    p.add_argument(
        "--random-model", choices=sorted(RANDOM_SHAPES), help="write and serve a random Llama of this shape"
    )
    p.add_argument("--device", default="cpu")
    p.add_argument("--concurrency", default="1,2,4,8", help="comma-separated N values")
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3, help="interleaved repetitions per N (median tok/s)")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--protocols", default="grpc,http")
    p.add_argument(
        "--server-arg", action="append", default=[], help="extra `pagedinfer serve` flag (repeatable)"
    )
    p.add_argument("--no-offline", action="store_true", help="skip the in-process peer")
    p.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        help="torch intra-op threads for server and offline alike (default: 1 on cpu, where OpenMP "
        "workers oversubscribe the cores next to the client processes; unset on cuda)",
    )
    p.add_argument("--out", default="bench/results")
    p.add_argument("--tag", default=None, help="file name tag (default: device)")
    args = p.parse_args(argv)
    args.levels = [int(x) for x in args.concurrency.split(",")]
    args.protocols = [x.strip() for x in args.protocols.split(",") if x.strip()]
    if args.torch_threads is None and args.device == "cpu":
        args.torch_threads = 1
    if args.torch_threads:
        os.environ["OMP_NUM_THREADS"] = str(args.torch_threads)  # the server child inherits it
    if args.random_model:
        args.model = str(
            write_random_llama(Path(tempfile.mkdtemp(prefix="random-llama-")), args.random_model)
        )
    # SIGTERM (timeouts in run_gpu.sh) still stops the server child through the finally below.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    server = Server(server_args(args)).start()
    try:
        info = httpx.get(f"http://127.0.0.1:{server.http_port}/v1/models").json()["data"][0]
        from pagedinfer.engine.server.proto_gen import inference_pb2  # noqa: F401  (stubs before timing)

        vocab = _vocab(server)
        results = asyncio.run(sweep(server, args, vocab))
    finally:
        server.stop()
    lines = [_fmt(r) for r in results]
    lines += ["", "serving overhead (server tok/s / offline tok/s, target >= 0.95):"]
    lines += [
        f"  {r.mode:5s} N={r.concurrency:<4d} ratio={r.ratio_vs_offline:.3f}"
        for r in results
        if r.ratio_vs_offline
    ]
    print("\n".join(lines[len(results) :]))
    _write(args, results, info, lines)
    return 0


def _vocab(server: Server) -> int:
    import grpc

    from pagedinfer.engine.server.proto_gen import inference_pb2 as pb
    from pagedinfer.engine.server.proto_gen import inference_pb2_grpc as pb_grpc

    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as ch:
        return pb_grpc.InferenceServiceStub(ch).GetModelInfo(pb.GetModelInfoRequest()).vocab_size


def _write(args, results: list[LevelResult], info: dict, lines: list[str]) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = args.tag or args.device
    payload = {
        "benchmark": "serving",
        "model": args.model if not args.random_model else f"random {args.random_model}",
        "served_model": info["id"],
        "device": args.device,
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
        },
        "workload": {
            "prompt_len": args.prompt_len,
            "max_tokens": args.max_tokens,
            "requests_per_client": args.requests_per_client,
            "rounds": args.rounds,
            "concurrency": args.levels,
            "greedy": True,
            "ignore_eos": True,
            "torch_threads": args.torch_threads,
        },
        "results": [asdict(r) for r in results],
    }
    (out / f"serving_{tag}.json").write_text(json.dumps(payload, indent=2))
    (out / f"serving_{tag}_summary.txt").write_text("\n".join(lines) + "\n")
    plot(results, out / f"serving_{tag}.png", f"pagedinfer serve: {args.model} on {args.device}")
    print(f"wrote {out / f'serving_{tag}.json'} and .png")


if __name__ == "__main__":
    sys.exit(main())
