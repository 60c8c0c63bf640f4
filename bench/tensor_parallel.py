"""Tensor parallelism (issue 48): one decode step of the sharded model, tp = 1 vs tp = 2.

    python3 bench/tensor_parallel.py --out OUT [--tps 1,2] [--shapes 8b,70b] [--batches 1,64]

Per shape, batch and tp: the median time of one decode step (every sequence one new token at
--context tokens of KV: the forward with its 2 all-reduces per layer and the LM head with its
all-gather) on every rank in lockstep, eager (the engine runs tp > 1 steps eagerly). tp = 1 is
the plain model (the engine's tp = 1 path), tp > 1 the engine's TensorParallelLlama, one process
per GPU over NCCL. Random bf16 weights; no checkpoint.

Floor of a step on one GPU: (its weight bytes + its KV bytes) / the device copy bandwidth
(measured in the same run) + 2 * layers * one all-reduce of the step's hidden rows + the LM
head's all-gather, each timed alone at its real size (the collectives' latency is most of them
at decode sizes). Also printed: the all-reduce bus bandwidth at 256 MiB (NVLink).

Shapes: 8b = Llama-3-8B; 70b = Llama-3-70B (hidden 8192, 64/8 heads, intermediate 28672, vocab
128256) with --layers-70b layers (default 20: tp = 1 must fit one 80 GB GPU; 80 needs 2 x H200
at tp = 2 and cannot run at tp = 1). single-stream ms/token = the batch-1 step; tok/s = batch /
step time. Writes OUT/tensor_parallel.json, .png and _summary.txt; prints tp2/tp1 ratios.
`--device cpu --shapes tiny` checks the script itself on gloo (no numbers worth reading).
"""

from __future__ import annotations

import dataclasses
import os
import queue as queue_module
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

SHAPES = ("8b", "70b", "tiny")


def model_shape(name: str, layers_70b: int):
    from pagedinfer.engine.config import ModelConfig
    from pagedinfer.engine.models.shapes import LLAMA3_8B

    if name == "8b":
        return LLAMA3_8B
    if name == "70b":
        return dataclasses.replace(
            LLAMA3_8B, hidden_size=8192, intermediate_size=28672, num_layers=layers_70b, num_heads=64
        )
    return ModelConfig("llama", 512, 128, 256, 2, 4, 2, 32, 2048)


def build(config, tp: int, rank: int, group, dtype, device):
    """The model of this rank with random weights: the plain model at tp = 1."""
    import torch

    from pagedinfer.engine.models.llama import LlamaForCausalLM
    from pagedinfer.engine.parallel.model import TensorParallelLlama
    from pagedinfer.engine.parallel.plan import ShardPlan

    if tp == 1:
        model = LlamaForCausalLM(config, dtype, device)
    else:
        model = TensorParallelLlama(ShardPlan(config, tp, rank), group, dtype, device)
    model.requires_grad_(False)
    gen = torch.Generator(device=device).manual_seed(rank)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        else:
            p.normal_(0.0, 0.02, generator=gen)
    return model


def decode_inputs(rank_config, batch: int, context: int, block_size: int, device, dtype, backend):
    """KV caches holding `context` tokens per sequence and one decode step's inputs."""
    import torch

    from pagedinfer.engine.worker.attn_metadata import AttentionMetadata
    from pagedinfer.engine.worker.kv_cache import allocate_kv_caches

    blocks_per_seq = -(-(context + 1) // block_size)
    caches = allocate_kv_caches(rank_config, batch * blocks_per_seq, block_size, device, dtype)
    tables = torch.arange(batch * blocks_per_seq, dtype=torch.int32, device=device).reshape(batch, -1)
    seq_lens = torch.full((batch,), context + 1, dtype=torch.int32, device=device)
    md = AttentionMetadata(
        slot_mapping=tables[:, context // block_size].long() * block_size + context % block_size,
        positions=torch.full((batch,), context, dtype=torch.int64, device=device),
        block_tables=tables,
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device),
        seq_lens=seq_lens,
        logits_indices=torch.arange(batch, device=device),
        max_query_len=1,
        max_seq_len=context + 1,
        is_pure_decode=True,
        backend=backend,
    )
    ids = torch.randint(0, min(1000, rank_config.vocab_size), (batch,), device=device)
    return caches, ids, md


def timed_ms(fn, iters: int, sync) -> float:
    """Median wall ms of fn() over iters, every rank synchronized before and after each."""
    samples = []
    for _ in range(iters):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def collective_ms(group, shape, dtype, iters: int, sync) -> tuple[float, float]:
    """(all-reduce ms, all-gather ms) of one tensor of `shape` alone."""
    import torch

    x = torch.ones(shape, dtype=dtype, device=group.device)
    reduce_ms = timed_ms(lambda: group.all_reduce(x), iters, sync)
    gather_ms = timed_ms(lambda: group.all_gather_rows(x), iters, sync)
    return reduce_ms, gather_ms


def measure(model, config, rank_config, batch: int, group, bandwidth, args, sync) -> dict:
    """One shape x batch x tp row: the step, its floor and its collectives."""
    import torch

    from pagedinfer.kernels import ops

    device, dtype = model.device, model.dtype
    backend = ops.select_backend(device, "auto")
    caches, ids, md = decode_inputs(rank_config, batch, args.context, 16, device, dtype, backend)
    kv_bytes = batch * args.context * 2 * config.num_layers * rank_config.num_kv_heads * config.head_dim
    kv_bytes *= dtype.itemsize
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())

    @torch.inference_mode()
    def step() -> None:
        hidden = model(ids, md.positions, caches, md)
        model.compute_logits(hidden[md.logits_indices], upcast=False, backend=backend)

    for _ in range(3):
        step()
    ms = timed_ms(step, args.iters, sync)
    reduce_ms = gather_ms = 0.0
    if group is not None:
        reduce_ms, _ = collective_ms(group, (batch, config.hidden_size), dtype, args.iters, sync)
        _, gather_ms = collective_ms(group, (batch, rank_config.vocab_size), dtype, args.iters, sync)
    floor = None
    if bandwidth is not None:
        floor = (weight_bytes + kv_bytes) / bandwidth / 1e6 + 2 * config.num_layers * reduce_ms + gather_ms
    return dict(
        shape=args.shape_names[config],
        layers=config.num_layers,
        batch=batch,
        tp=1 if group is None else group.world_size,
        step_ms=ms,
        floor_ms=floor,
        tok_s=batch / ms * 1e3,
        weight_gb_per_gpu=weight_bytes / 1e9,
        kv_gb_per_gpu=kv_bytes / 1e9,
        all_reduce_ms=reduce_ms,
        all_gather_ms=gather_ms,
    )


def run_rank(rank: int, args, tp: int, port: int, queue) -> None:
    import torch
    import torch.distributed as dist

    from pagedinfer.engine.parallel.group import GroupAddress, TPGroup
    from pagedinfer.engine.parallel.plan import ShardPlan

    is_cuda = args.device == "cuda"
    device = torch.device("cuda", rank) if is_cuda else torch.device("cpu")
    if is_cuda:
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if is_cuda else torch.float32
    group = TPGroup(GroupAddress("127.0.0.1", port, tp), rank, device) if tp > 1 else None

    def sync() -> None:
        if is_cuda:
            torch.cuda.synchronize(device)
        if group is not None:
            dist.barrier()

    rows = []
    bandwidth = common.measure_copy_bandwidth(args.rep_ms) if is_cuda else None
    big_reduce = None
    if group is not None:
        n = (256 << 20) // 2
        big_reduce = collective_ms(group, (n,), dtype, args.iters, sync)[0]
    args.shape_names = {}
    for shape in args.shapes:
        config = model_shape(shape, args.layers_70b)
        args.shape_names[config] = shape
        model = build(config, tp, rank, group, dtype, device)
        rank_config = ShardPlan(config, tp, rank).rank_config() if tp > 1 else config
        for batch in args.batches:
            rows.append(measure(model, config, rank_config, batch, group, bandwidth, args, sync))
        del model
        if is_cuda:
            torch.cuda.empty_cache()
    if rank == 0:
        big = None if big_reduce is None else 2 * (tp - 1) / tp * (256 << 20) / big_reduce / 1e6
        queue.put(dict(rows=rows, copy_gb_s=bandwidth, all_reduce_bus_gb_s_256mib=big))
    if group is not None:
        group.close()


def run_tp(args, tp: int) -> dict:
    import torch.multiprocessing as mp

    from pagedinfer.engine.parallel.workers import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=run_rank, args=(r, args, tp, port, queue)) for r in range(tp)]
    for p in procs:
        p.start()
    result = None
    while result is None and not any(p.exitcode for p in procs):
        try:
            result = queue.get(timeout=1.0)
        except queue_module.Empty:  # the ranks are still measuring
            continue
    for p in procs:
        p.join(None if result is not None else 10)
    if any(p.exitcode for p in procs):
        raise RuntimeError(f"tp {tp}: a rank failed ({[p.exitcode for p in procs]})")
    return result


def plot(rows: list[dict], path: Path) -> None:
    drawn = common.subplots(path, 1, 1, figsize=(9, 4))
    if drawn is None:
        return
    fig, ax = drawn
    labels = [f"{r['shape']} L{r['layers']} b{r['batch']} tp{r['tp']}" for r in rows]
    xs = range(len(rows))
    ax.bar(xs, [r["step_ms"] for r in rows], label="measured")
    floors = [r["floor_ms"] or 0 for r in rows]
    ax.scatter(xs, floors, color="black", marker="_", s=400, label="floor", zorder=3)
    ax.set_xticks(list(xs), labels, rotation=45, ha="right", fontsize=7)
    ax.set_ylabel("decode step, ms")
    ax.set_title("tensor parallelism: one decode step (eager)")
    ax.legend()
    common.save(fig, path, dpi=120)


def main() -> None:
    parser = common.gpu_parser(__doc__, rep_ms=100)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--tps", default="1,2")
    parser.add_argument("--shapes", default="8b,70b")
    parser.add_argument("--layers-70b", type=int, default=20)
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--iters", type=int, default=30)
    args = parser.parse_args()
    args.shapes = [s for s in args.shapes.split(",") if s]
    args.batches = [int(b) for b in args.batches.split(",")]
    tps = [int(t) for t in args.tps.split(",")]
    if args.device == "cuda":
        import torch

        if not common.has_cuda("tensor_parallel"):
            return
        if torch.cuda.device_count() < max(tps):
            print(
                f"tensor_parallel: tp {max(tps)} needs {max(tps)} GPUs, {torch.cuda.device_count()} visible"
            )
            return
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off (the machines' KINDS.md)
    results = {"device": args.device, "context": args.context, "runs": {}}
    for tp in tps:
        results["runs"][str(tp)] = run_tp(args, tp)
    rows = [r for run in results["runs"].values() for r in run["rows"]]
    lines = [f"copy bandwidth {results['runs'][str(tps[0])]['copy_gb_s']} GB/s"]
    for tp, run in results["runs"].items():
        if run["all_reduce_bus_gb_s_256mib"]:
            lines.append(
                f"tp {tp}: all-reduce bus bandwidth at 256 MiB {run['all_reduce_bus_gb_s_256mib']:.0f} GB/s"
            )
    base = {(r["shape"], r["batch"]): r for r in rows if r["tp"] == 1}
    for r in rows:
        floor = f"{r['floor_ms']:.2f}" if r["floor_ms"] is not None else "-"
        line = (
            f"{r['shape']:>4} L{r['layers']} batch {r['batch']:>3} tp {r['tp']}: {r['step_ms']:.2f} ms/step "
            f"(floor {floor}), {r['tok_s']:.0f} tok/s, all-reduce {r['all_reduce_ms'] * 1e3:.0f} us"
        )
        ref = base.get((r["shape"], r["batch"]))
        if ref is not None and r["tp"] != 1:
            line += f"; tp{r['tp']}/tp1 = {r['step_ms'] / ref['step_ms']:.2f}x (goal <= 0.6x at batch 1)"
        lines.append(line)
    print("\n".join(lines))
    common.write_results(args.out, "tensor_parallel", results, lines)
    plot(rows, args.out / "tensor_parallel.png")


if __name__ == "__main__":
    main()
