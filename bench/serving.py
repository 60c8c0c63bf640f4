"""Serving benchmark: N concurrent streaming clients (gRPC and OpenAI HTTP/SSE) against a real
`pagedinfer serve` on loopback, sweeping N; then the same workload on the offline AsyncEngine
in-process (no server) as the peer. Reports TTFT and ITL p50/p99 (client-side), output
tokens/s, and the serving overhead ratio: server tokens/s / offline tokens/s (target >= 0.95).

    .venv/bin/python bench/serving.py                      # CPU, SmolLM2, N = 1,2,4,8
    python3 bench/serving.py --model hf://... --device cuda --concurrency 1,8,32,128 --max-tokens 128
    python3 bench/serving.py --device cuda --random-model llama-8b --concurrency 1,16,64  # bench/run_gpu.sh
    .venv/bin/python bench/serving.py --variant as2=--api-server-count=2   # + 2 API-server processes

Each client runs a closed loop of --requests-per-client requests (prompt of --prompt-len token
ids, greedy, ignore_eos, exactly --max-tokens output tokens). The server and the offline engine
are both alive, and --rounds interleave the three modes at each N (a shared machine's noise
hits all alike). gRPC/HTTP clients run in --client-procs processes of their own
(bench/serving_clients.py), never on the server's GIL. Writes JSON + PNG + a summary to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (bench/ is not a package)
from serving_clients import ClientPool, RequestResult, Timer  # noqa: E402


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
    # CPU cores busy during the level (CPU seconds / wall seconds): the server's main process
    # (HTTP/gRPC/asyncio), its children (the engine core process), and all client processes.
    # With --api-server-count N > 1: the launcher plus the N API servers, the core, the clients.
    server_cpu_cores: float | None = None
    engine_core_cpu_cores: float | None = None
    client_cpu_cores: float | None = None


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


# ---- the in-process peer (offline) ----------------------------------------------------------
async def offline_request(engine, params, prompt_ids: list[int]) -> RequestResult:
    timer = Timer()
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
_LLAMA_8B_BODY = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
)
RANDOM_SHAPES = {  # Llama bodies; "vocab" 258 = byte-level (256 bytes + 2 specials), tied embeddings
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
    # Llama-3-8B as served: 128,256-token vocabulary and an untied lm_head (the logits GEMM and the
    # detokenizer see the real sizes); the tokenizer is synthetic (see _synthetic_tokenizer).
    "llama-8b": dict(_LLAMA_8B_BODY, vocab_size=128256, tie_word_embeddings=False),
}
_NUM_SPECIAL = 2  # <|im_start|> (bos), <|im_end|> (eos): the last two ids


def _synthetic_tokenizer(vocab_size: int):
    """Byte-level BPE: ids 0-255 are the bytes, ids 256.. are synthetic words (' w<base-26 id>'),
    the last two are the specials. No merges: encoding text yields bytes, decoding any id works."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    for i in range(len(alphabet), vocab_size - _NUM_SPECIAL):
        word, k = "", i
        while k:
            word, k = chr(ord("a") + k % 26) + word, k // 26
        vocab["\u0120w" + word] = i  # \u0120 is the byte-level spelling of a space
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<|im_start|>", special=True), AddedToken("<|im_end|>", special=True)])
    return tok


def _random_weights(shapes: dict[str, tuple[int, ...]], seed: int):
    """bf16 tensors scaled by fan_in**-0.5, cut from one shared random pool at random offsets:
    an 8B checkpoint in seconds (torch.randn per tensor would take about a minute of CPU)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    pool = torch.randn(1 << 26, generator=g).to(torch.bfloat16)  # 64M values, 128 MB
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            yield name, torch.ones(shape, dtype=torch.bfloat16)
            continue
        numel = shape[0] * shape[1]
        out = torch.empty(numel, dtype=torch.bfloat16)
        pos = 0
        while pos < numel:  # tiles of the pool, each from its own random offset
            take = min(numel - pos, pool.numel() // 2)
            off = int(torch.randint(0, pool.numel() - take + 1, (1,), generator=g))
            out[pos : pos + take] = pool[off : off + take]
            pos += take
        yield name, out.view(shape).mul_(shape[1] ** -0.5)


def write_random_llama(folder: Path, shape: str, seed: int = 0) -> Path:
    """A random Llama checkpoint (HF layout: config.json, safetensors shards, tokenizer.json)."""
    cfg = {"vocab_size": 258, "tie_word_embeddings": True, **RANDOM_SHAPES[shape]}
    cfg |= {"max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 500000.0}
    cfg |= {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "bfloat16"}
    vocab = cfg["vocab_size"]
    cfg |= {"bos_token_id": vocab - 2, "eos_token_id": vocab - 1}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    _synthetic_tokenizer(vocab).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"})
    )
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    kv = cfg["num_key_value_heads"] * (h // cfg["num_attention_heads"])
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,)}
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (vocab, h)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (h, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, h),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        }
    _save_shards(folder, _random_weights(shapes, seed))
    return folder


def _save_shards(folder: Path, weights, max_shard_bytes: int = 2 << 30) -> None:
    """Shards of <= ~2 GB plus model.safetensors.index.json: the host never holds more than one
    shard (and its serialized copy), not the 16 GB of an 8B model twice."""
    from safetensors.torch import save_file

    weight_map: dict[str, str] = {}
    shard: dict = {}
    names: list[str] = []

    def flush() -> None:
        name = f"model-{len(names) + 1:05d}.safetensors"
        save_file(shard, str(folder / name))
        weight_map.update(dict.fromkeys(shard, name))
        names.append(name)
        shard.clear()

    size = 0
    for key, tensor in weights:
        shard[key] = tensor
        size += tensor.numel() * tensor.element_size()
        if size >= max_shard_bytes:
            flush()
            size = 0
    if shard:
        flush()
    index = {
        "metadata": {"total_size": sum((folder / n).stat().st_size for n in names)},
        "weight_map": weight_map,
    }
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


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
        return self.launch().wait_ready(timeout)

    def launch(self) -> Server:
        argv = [sys.executable, "-m", "pagedinfer.engine.cli", "serve", "--host", "127.0.0.1"]
        argv += ["--http-port", str(self.http_port), "--grpc-port", str(self.grpc_port), *self.args]
        self.log = tempfile.NamedTemporaryFile("w+", prefix="bench-serve-", suffix=".log", delete=False)  # noqa: SIM115
        self.proc = subprocess.Popen(
            argv, stdout=self.log, stderr=subprocess.STDOUT, cwd=tempfile.gettempdir()
        )
        return self

    def wait_ready(self, timeout: float = 600) -> Server:
        assert self.proc is not None
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

    def core_pid(self) -> int | None:
        """The engine core's pid when a launcher runs several API servers (its log says)."""
        match = re.search(r"launcher \(pid \d+\): engine core pid (\d+)", Path(self.log.name).read_text())
        return int(match.group(1)) if match else None

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


async def sweep(servers: dict[str, Server], args, vocab: int) -> list[LevelResult]:
    """Rounds interleave the modes (offline, gRPC, HTTP) at each N, so a noisy neighbour hits all
    of them alike; tokens/s is the median over rounds, latencies pool every request. gRPC and
    HTTP clients run in `--client-procs` processes of their own; the offline peer's clients are
    its own in-process consumers (that is the workload being compared against)."""
    from pagedinfer.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    engine = None if args.no_offline else await _offline_engine(args)
    ports = {label: (s.http_port, s.grpc_port) for label, s in servers.items()}
    pool = ClientPool(args.client_procs, ports, args.max_tokens, max(args.levels))
    # mode "grpc" / "http" on the base server, "grpc/LABEL" on the --variant server LABEL
    served = [p + (f"/{label}" if label else "") for label in servers for p in args.protocols]
    modes = (["offline"] if engine is not None else []) + served
    warm = prompts(1, args.prompt_len, vocab)[0]
    out = []
    try:
        pool.warm(served, warm)
        if engine is not None:
            await offline_request(engine, params, warm)
        for n in args.levels:
            ps = prompts(n * args.requests_per_client, args.prompt_len, vocab)
            rounds: dict[str, list] = {m: [] for m in modes}
            cpu: dict[str, list[float]] = {m: [0.0, 0.0, 0.0] for m in modes}  # server, core, clients
            for r in range(args.rounds):
                for mode in modes[r % len(modes) :] + modes[: r % len(modes)]:  # rotate the order
                    if mode == "offline":
                        one = lambda k, ps=ps: offline_request(engine, params, ps[k])  # noqa: E731
                        level = await run_level(n, args.requests_per_client, one)
                    else:
                        server = servers[mode.partition("/")[2]]
                        pid, core_pid = server.proc.pid, server.core_pid()
                        before = server_cpu(pid, core_pid)
                        level = await pool.run_level(mode, n, args.requests_per_client, ps)
                        after = server_cpu(pid, core_pid)
                        cpu[mode][0] += after[0] - before[0]
                        cpu[mode][1] += after[1] - before[1]
                        cpu[mode][2] += pool.last_cpu_s
                    rounds[mode].append(level)
            for mode in modes:
                out.append(summarize_rounds(mode, n, rounds[mode]))
                if mode != "offline":
                    wall = sum(w for _, w in rounds[mode])
                    res = out[-1]
                    res.server_cpu_cores, res.engine_core_cpu_cores, res.client_cpu_cores = (
                        round(c / wall, 3) for c in cpu[mode]
                    )
                print(_fmt(out[-1]), flush=True)
    finally:
        pool.close()
        if engine is not None:
            await engine.shutdown(0)
    offline = {r.concurrency: r.tokens_per_second for r in out if r.mode == "offline"}
    for r in out:
        if r.mode != "offline" and r.concurrency in offline:
            r.ratio_vs_offline = r.tokens_per_second / offline[r.concurrency]
    return out


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _cpu_seconds(pid: int) -> float:
    """utime + stime of one process (0 if it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS  # stat fields 14 and 15


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids += [int(k) for k in (task / "children").read_text().split()]
        except OSError:
            continue  # a thread that ended during the scan
    return kids


def server_cpu(pid: int, core_pid: int | None = None) -> tuple[float, float]:
    """CPU seconds so far of the API server side and of the engine core. One server process: it
    and its direct children (the engine core). A launcher (--api-server-count N > 1, whose log
    names `core_pid`): the launcher and its children but the core, and the core."""
    kids = sum(_cpu_seconds(k) for k in _children(pid) if k != core_pid)
    if core_pid is None:
        return _cpu_seconds(pid), kids
    return _cpu_seconds(pid) + kids, _cpu_seconds(core_pid)


def summarize_rounds(mode: str, n: int, rounds: list[tuple[list[RequestResult], float]]) -> LevelResult:
    pooled = summarize(mode, n, [x for results, _ in rounds for x in results], sum(w for _, w in rounds))
    per_round = sorted(sum(x.num_tokens for x in results) / wall for results, wall in rounds)
    pooled.tokens_per_second = per_round[len(per_round) // 2]
    return pooled


def _fmt(r: LevelResult) -> str:
    ratio = f" ratio_vs_offline={r.ratio_vs_offline:.3f}" if r.ratio_vs_offline is not None else ""
    return (
        f"{r.mode:14s} N={r.concurrency:<4d} reqs={r.num_requests:<4d} tok/s={r.tokens_per_second:8.2f} "
        f"TTFT p50/p99={r.ttft_p50 * 1e3:8.1f}/{r.ttft_p99 * 1e3:8.1f} ms ITL p50/p99={r.itl_p50 * 1e3:7.1f}/{r.itl_p99 * 1e3:7.1f} ms{ratio}"
        + (
            f" cpu cores server/core/clients={r.server_cpu_cores:.2f}/{r.engine_core_cpu_cores:.2f}/{r.client_cpu_cores:.2f}"
            if r.server_cpu_cores is not None
            else ""
        )
    )


def server_args(args) -> list[str]:
    """Flags for the server and (parsed by the same parser) the in-process offline engine."""
    base = ["--model", args.model, "--device", args.device, "--max-num-seqs", str(max(args.levels))]
    if args.device.startswith("cuda"):  # all engines live at once (interleaved rounds): share the GPU
        num_engines = 2 + len(args.variant)
        base += ["--gpu-memory-utilization", f"{0.84 / num_engines:.3f}"]
    if args.max_model_len:
        base += ["--max-model-len", str(args.max_model_len)]
    return base + args.server_arg


def plot(results: list[LevelResult], path: Path, title: str) -> None:
    drawn = common.subplots(path, 1, 2, figsize=(11, 4))
    if drawn is None:
        return
    fig, (ax1, ax2) = drawn
    for mode in dict.fromkeys(r.mode for r in results):
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
    common.save(fig, path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="builtin://smollm2-135m")
    p.add_argument(
        "--random-model", choices=sorted(RANDOM_SHAPES), help="write and serve a random Llama of this shape"
    )
    p.add_argument("--device", default="cpu")
    p.add_argument("--concurrency", default="1,2,4,8", help="comma-separated N values")
    # Defaults: one burst of N requests of 64 tokens, 5 rounds (as run_gpu.sh's burst). A CPU step
    # is 70-150 ms: with 16-token closed-loop requests, one request reaching the engine just
    # after a step began cost ~6% of its time, and the ratio measured that alignment and noise
    # (0.84-1.10 over runs of one config, bench/NOTES.md, CPU serving 2026-12-04).
    p.add_argument("--requests-per-client", type=int, default=1)
    p.add_argument("--rounds", type=int, default=5, help="interleaved repetitions per N (median tok/s)")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--protocols", default="grpc,http")
    p.add_argument(
        "--server-arg", action="append", default=[], help="extra `pagedinfer serve` flag (repeatable)"
    )
    p.add_argument("--no-offline", action="store_true", help="skip the in-process peer")
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="LABEL=FLAGS",
        help="also serve with these extra flags (e.g. 'ep=--engine-process', "
        "'as4=--api-server-count 4'); its modes are grpc/LABEL, http/LABEL, interleaved with the rest "
        "(repeatable)",
    )
    p.add_argument(
        "--client-procs",
        type=int,
        default=max(1, (os.cpu_count() or 1) // 4),
        help="processes running the gRPC/HTTP clients (default: a quarter of the cores, at least 1)",
    )
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

    servers = {"": Server(server_args(args))}
    for spec in args.variant:
        label, _, flags = spec.partition("=")
        servers[label] = Server(server_args(args) + flags.split())
    try:
        for s in servers.values():  # all load at once
            s.launch()
        for s in servers.values():
            s.wait_ready()
        server = servers[""]
        info = httpx.get(f"http://127.0.0.1:{server.http_port}/v1/models").json()["data"][0]
        from pagedinfer.engine.server.proto_gen import inference_pb2  # noqa: F401  (stubs before timing)

        vocab = _vocab(server)
        results = asyncio.run(sweep(servers, args, vocab))
    finally:
        for s in servers.values():
            s.stop()
        if args.random_model:  # 16 GB for the 8B shape: leave the disk as it was
            shutil.rmtree(args.model, ignore_errors=True)
    lines = [_fmt(r) for r in results]
    lines += ["", "serving overhead (server tok/s / offline tok/s, target >= 0.95):"]
    lines += [
        f"  {r.mode:14s} N={r.concurrency:<4d} ratio={r.ratio_vs_offline:.3f}"
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
            "client_procs": args.client_procs,
            "server_args": args.server_arg,
            "variants": args.variant,
        },
        "results": [asdict(r) for r in results],
    }
    (out / f"serving_{tag}.json").write_text(json.dumps(payload, indent=2))
    (out / f"serving_{tag}_summary.txt").write_text("\n".join(lines) + "\n")
    plot(results, out / f"serving_{tag}.png", f"pagedinfer serve: {args.model} on {args.device}")
    print(f"wrote {out / f'serving_{tag}.json'} and .png")


if __name__ == "__main__":
    sys.exit(main())
