"""Served side by side with vLLM (issue 47): `vllm serve` and `pagedinfer serve` on the same GPU,
one after the other, under bench/serving.py's client (bench/serving_clients.py: streaming OpenAI
/v1/completions over HTTP/SSE, token-id prompts, greedy, ignore_eos, client processes of their
own) at N concurrent clients. Reports per engine and N: output tok/s (median over rounds), TTFT
p50/p99 and inter-chunk latency p50/p99 (pooled over rounds), as bench/serving.py does.

Both serve the same random Llama-3-8B-shaped folder (bench/serving.py's `write_random_llama`:
config.json, the synthetic byte-level tokenizer, random bf16 safetensors); vLLM ignores the
weights (`--load-format dummy`) and detokenizes with the same tokenizer. Each engine gets the
whole GPU in turn (0.9 of its memory) with its own defaults otherwise; --vllm-arg / --ours-arg add
flags (e.g. `--vllm-arg=--max-num-seqs=256`).

The carried vLLM (../shared/vllm-peer/README.md) lives in /tmp/vsite; the two extra wheels that
`vllm serve` imports beyond the offline peer's set (bench/vllm_serve_wheels.txt) in /tmp/vsite-serve.

    python3 bench/serving_vllm.py --out OUT                      # N = 1,16,64,256, 512 -> 128 tokens
    python3 bench/serving_vllm.py --engines ours --concurrency 1,16 --out OUT
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving import (  # noqa: E402  (bench/ is not a package)
    LevelResult,
    Server,
    _fmt,
    _free_port,
    plot,
    prompts,
    summarize_rounds,
    write_random_llama,
)
from serving_clients import ClientPool  # noqa: E402

VLLM_ENV = {
    # flashinfer is not carried; greedy sampling never uses it (../shared/vllm-peer/README.md)
    "VLLM_USE_FLASHINFER_SAMPLER": "0",
    "TVM_FFI_DISABLE_TORCH_C_DLPACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


@dataclass
class VllmServer:
    """`vllm serve` in its own process group (its engine core is a child process)."""

    model: str
    site: str
    args: list[str]
    http_port: int = field(default_factory=_free_port)
    grpc_port: None = None
    proc: subprocess.Popen | None = None

    def launch(self) -> VllmServer:
        argv = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", self.model]
        argv += ["--host", "127.0.0.1", "--port", str(self.http_port), *self.args]
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | VLLM_ENV
        env["PYTHONPATH"] = self.site  # only vLLM's wheels: the project's (newer pydantic, ...) stay out
        self.log = tempfile.NamedTemporaryFile("w+", prefix="vllm-serve-", suffix=".log", delete=False)  # noqa: SIM115
        print("launch:", " ".join(argv), flush=True)
        self.proc = subprocess.Popen(
            argv,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=tempfile.gettempdir(),
            start_new_session=True,
        )
        return self

    def wait_ready(self, timeout: float) -> VllmServer:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited ({self.proc.returncode}): {self.log_tail()}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.http_port}/v1/models", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"vllm serve not ready after {timeout:.0f} s: {self.log_tail()}")

    def log_tail(self, chars: int = 3000) -> str:
        return Path(self.log.name).read_text(errors="replace")[-chars:]

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)


def ours_server(args, model: str) -> Server:
    flags = ["--model", model, "--device", args.device, "--max-model-len", str(args.max_model_len)]
    flags += ["--gpu-memory-utilization", str(args.gpu_memory_utilization), *args.ours_arg]
    return Server(flags)


def vllm_server(args, model: str, extra: list[str] = ()) -> VllmServer:
    flags = ["--load-format", "dummy", "--dtype", "bfloat16", "--seed", "0"]
    flags += [
        "--max-model-len",
        str(args.max_model_len),
        "--gpu-memory-utilization",
        str(args.gpu_memory_utilization),
    ]
    return VllmServer(model, args.vllm_site, flags + list(extra) + args.vllm_arg)


def start(engine: str, args, model: str, info: dict):
    """Start one engine's server; vLLM falls back to --skip-tokenizer-init if the tokenizer fails."""
    t0 = time.monotonic()
    if engine == "ours":
        server = ours_server(args, model)
        server.launch().wait_ready(args.ready_timeout)
    else:
        server = vllm_server(args, model).launch()
        try:
            server.wait_ready(args.ready_timeout)
        except RuntimeError as exc:  # exited: retry once without the tokenizer
            info["vllm_first_start_error"] = str(exc)[-2000:]
            server = vllm_server(args, model, ["--skip-tokenizer-init"]).launch()
            server.wait_ready(args.ready_timeout)
        try:
            info["vllm_version"] = httpx.get(f"http://127.0.0.1:{server.http_port}/version", timeout=5).json()
        except (httpx.HTTPError, ValueError) as exc:
            info["vllm_version"] = repr(exc)
    info[f"{engine}_startup_s"] = round(time.monotonic() - t0, 1)
    print(f"{engine} ready after {info[f'{engine}_startup_s']} s", flush=True)
    return server


async def sweep_engine(pool: ClientPool, mode: str, args) -> list[LevelResult]:
    """Warm (one request per client process, then one untimed burst at the largest N), then each
    N for --rounds rounds: one burst of N requests, one per client."""
    warm = prompts(max(args.levels) + 1, args.prompt_len, args.vocab)
    pool.warm([mode], warm[-1])
    if args.warm_burst:
        await pool.run_level(mode, max(args.levels), 1, warm[: max(args.levels)])
    out = []
    for n in args.levels:
        ps = prompts(n, args.prompt_len, args.vocab)
        rounds = [await pool.run_level(mode, n, 1, ps) for _ in range(args.rounds)]
        out.append(summarize_rounds(mode, n, rounds))
        print(_fmt(out[-1]), flush=True)
    return out


def run(args) -> dict:
    model = str(write_random_llama(Path(tempfile.mkdtemp(prefix="random-llama-")), args.shape))
    args.vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    info: dict = {}
    results: list[LevelResult] = []
    servers: dict = {}
    try:
        for engine in args.engines:
            try:
                server = start(engine, args, model, info)
            except (RuntimeError, TimeoutError) as exc:
                info[f"{engine}_error"] = str(exc)[-3000:]
                print(f"{engine} failed to start: {exc}", flush=True)
                continue
            servers[engine] = server
            ports = {engine: (server.http_port, server.grpc_port)}
            pool = ClientPool(args.client_procs, ports, args.max_tokens, max(args.levels))
            try:
                results += asyncio.run(sweep_engine(pool, f"http/{engine}", args))
            except Exception as exc:  # one engine failing mid-sweep must not lose the other's rows
                info[f"{engine}_error"] = f"{type(exc).__name__}: {exc}"
                print(f"{engine} sweep failed: {exc!r}", flush=True)
            finally:
                pool.close()
                server.stop()
                servers[engine] = None
            write(args, results, info)
    finally:
        for server in servers.values():
            if server is not None:
                server.stop()
        shutil.rmtree(model, ignore_errors=True)  # 16 GB
    return write(args, results, info)


def gpu_name() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


def write(args, results: list[LevelResult], info: dict) -> dict:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    payload = {
        "benchmark": "serving_vllm",
        "gpu": gpu_name(),
        "model": f"random Llama ({args.shape}, bench/serving.py), bf16; vLLM: --load-format dummy",
        "workload": {
            "protocol": "OpenAI /v1/completions, streaming SSE, token-id prompts",
            "prompt_len": args.prompt_len,
            "max_tokens": args.max_tokens,
            "requests_per_client": 1,
            "rounds": args.rounds,
            "concurrency": args.levels,
            "greedy": True,
            "ignore_eos": True,
            "client_procs": args.client_procs,
            "gpu_memory_utilization": args.gpu_memory_utilization,
            "max_model_len": args.max_model_len,
            "vllm_args": args.vllm_arg,
            "ours_args": args.ours_arg,
        },
        "info": info,
        "results": [asdict(r) for r in results],
    }
    (out / "serving_vllm.json").write_text(json.dumps(payload, indent=2))
    lines = [_fmt(r) for r in results] + [
        f"{k}: {v}" for k, v in info.items() if k.endswith(("_s", "_error"))
    ]
    (out / "serving_vllm_summary.txt").write_text("\n".join(lines) + "\n")
    if results:
        plot(results, out / "serving_vllm.png", f"vLLM serve vs pagedinfer serve, 8B shape, {payload['gpu']}")
    return payload


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", default="vllm,ours", help="served one after the other, in this order")
    p.add_argument("--concurrency", default="1,16,64,256")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--no-warm-burst", dest="warm_burst", action="store_false")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument(
        "--shape", default="llama-8b", help="bench/serving.py's RANDOM_SHAPES (tiny: a CPU smoke run)"
    )
    p.add_argument("--device", default="cuda", help="pagedinfer serve --device (cpu: a smoke run)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--vllm-site", default="/tmp/vsite:/tmp/vsite-serve", help="PYTHONPATH of vllm serve")
    p.add_argument("--vllm-arg", action="append", default=[], help="extra `vllm serve` flag (repeatable)")
    p.add_argument("--ours-arg", action="append", default=[], help="extra `pagedinfer serve` flag")
    p.add_argument("--ready-timeout", type=float, default=420)
    p.add_argument("--client-procs", type=int, default=max(1, (os.cpu_count() or 1) // 4))
    p.add_argument("--out", default="bench/results")
    args = p.parse_args(argv)
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    args.levels = [int(x) for x in args.concurrency.split(",")]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run_gpu.sh's timeout: servers still stop
    payload = run(args)
    print("\n".join(_fmt(LevelResult(**r)) for r in payload["results"]))
    return 0 if payload["results"] and not any(k.endswith("_error") for k in payload["info"]) else 1


if __name__ == "__main__":
    sys.exit(main())
