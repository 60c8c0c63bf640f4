"""Speculative decoding: tokens/s and ms/token with and without speculation, side by side.

Each workload runs one engine; every row measures `use_speculation=False` requests (baseline:
plain steps, planned ahead with async scheduling on CUDA as an engine without speculation runs
them) and speculative ones on the same engine, same prompts, greedy (or seeded sampling,
--temperature), and records whether the outputs match (they must under greedy, and with seeded
sampling for n-gram; the pair's rejection sampling draws other noise than plain decoding).
  (a) ngram: the n-gram proposer on editing tasks with SmolLM2 (rewrite a given text with one
      substitution, or fix its typos: the output copies long spans of the prompt, what prompt
      lookup is made for; each answer ends at the model's EOS, at most --max-tokens);
  (b) pair: a Llama-3-8B-shaped random bf16 target with a draft made of its own first L layers;
      the target's later layers are scaled down so the pair agrees (bench/spec_pair.py says how;
      the construction is recorded in the JSON);
  (c) selfdraft (CPU notes only): SmolLM2 verified by a subset of its own layers.
For each row: acceptance alpha (solved from the mean tokens emitted per verifying step), c (one
draft token's proposer time / one plain decode step of the same batch, same run), K, the
theoretical speedup (1 - alpha^(K+1)) / ((1 - alpha) (K c + 1)) and measured / theoretical;
over the steps with the whole batch running (`full-B`, against the theory at that window's own
alpha: acceptance varies over a response), that ratio splits into the tokens a forward pass
gave over the formula's (`tok/f`) and a verifying forward pass's time over a plain one's (`vstep`).
The formula assumes a draft every step; an n-gram proposer has none where the text holds no match.
A second table gives the ratios against the theory at alpha over every sequence-step that asked
for drafts, a step without a match counted as a draft rejected at its first token
(speculative_report.alpha_all_steps): there tok/f is 1 by construction and the full-batch ratio
is the verification's cost alone (1 / vstep at c = 0). Both alphas are in the JSON. The second
is the one the issue's target is judged on (bench/NOTES.md, session 35): it is E[beta] over every
step the proposer was asked, as the formula takes it, and a chained step does verify rows for a
sequence with no match; the first alpha is acceptance given a match (vLLM's acceptance rate
counts drafted tokens only), whose tok/f is the proposer's coverage, kept as a diagnostic.

    python -P bench/speculative.py --device cuda --model /path/smollm2.gguf --out OUT   # GPU: (a) + (b)
    python -P bench/speculative.py --workloads pair --smoke --out /tmp/x                 # CPU smoke of (b)
(-P as run_gpu.sh runs it; bench/ goes on sys.path below, for the sibling modules.) Each row times a
plain run right before its speculative one (`--rounds N` repeats the pair, median round kept).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from speculative_report import (  # noqa: E402  (bench/ is not a package)
    Timed,
    all_steps_columns,
    decode_ms_per_token,
    draft_accounting,
    full_batch_columns,
    full_batch_tokens_per_host_step,
    full_steps,
    mean_request_ms_per_token,
    phase_medians,
    plot,
    prefix_fraction,
    refilled_row,
    solve_alpha,
    step_mean_max,
    step_median,
    step_trace,
    summary,
    theoretical_speedup,
)
from speculative_workloads import Workload, pair_workload, smollm2_workload  # noqa: E402
from throughput_lib import run_engine_closed_loop, run_engine_requests  # noqa: E402

from pagedinfer.engine.config import SpeculativeConfig  # noqa: E402
from pagedinfer.engine.llm import LLM  # noqa: E402
from pagedinfer.engine.sampling_params import SamplingParams  # noqa: E402
from pagedinfer.engine.spec_decode.factory import build_speculative_decoder  # noqa: E402


def set_speculation(llm: LLM, config: SpeculativeConfig, num_blocks: int) -> None:
    """A fresh speculative decoder for this K; verification graphs recaptured for 1 + K."""
    runner = llm.core.runner
    spec = build_speculative_decoder(
        config,
        runner.model,
        llm.tokenizer,
        num_blocks=num_blocks,
        block_size=16,
        max_model_len=llm.max_model_len,
        attention_backend=runner.config.attention_backend,
    )
    llm.core.spec_decoder = runner.spec_decoder = spec
    if runner.graphs is not None and runner.config.num_speculative_tokens != config.num_speculative_tokens:
        runner.config = replace(runner.config, num_speculative_tokens=config.num_speculative_tokens)
        runner.graphs = None
        runner.capture_cuda_graphs()
    if runner.graphs is not None:
        spec.capture_cuda_graphs(runner.config.max_num_seqs)  # the draft model's steps


def baseline(core, prompts: list[list[int]], params: SamplingParams):
    """The plain run, its median plain decode step (ms), and how many of its steps were planned
    ahead (async scheduling: what an engine without speculation does on CUDA)."""
    ahead = core.num_lookahead_steps
    base = run_engine_requests(core, prompts, replace(params, use_speculation=False))
    steps = sorted(s["ms"] for s in base.steps if s["pure_decode"])
    return base, steps[len(steps) // 2], core.num_lookahead_steps - ahead


def gpu_idle_fraction(run) -> float | None:
    """The device's idle time between steps over its idle + busy time (None off CUDA)."""
    total = run.gpu_idle_s + run.gpu_busy_s
    return round(run.gpu_idle_s / total, 4) if total > 0 else None


def alpha_since(before, stats, k: int) -> float:
    """Acceptance alpha solved from the mean tokens emitted per verifying sequence-step between
    two snapshots of the decoder's stats."""
    verifying = stats.num_verified_sequences - before.num_verified_sequences
    emitted = stats.num_emitted_tokens - before.num_emitted_tokens
    return solve_alpha(emitted / verifying if verifying else 1.0, k)


def measure(
    core,
    prompts: list[list[int]],
    base,
    base_step_ms: float,
    base_ahead: int,
    request_params: SamplingParams,
    k: int,
) -> dict:
    spec = core.spec_decoder
    params = replace(request_params, use_speculation=True)
    before = replace(spec.stats)
    timer = Timed(spec.proposer.propose)
    spec.proposer.propose = timer
    # A draft model's chained launches (enqueued by the runner, not `propose`): their host time
    launches = None
    if hasattr(spec.proposer, "launch_chained"):
        launches = Timed(spec.proposer.launch_chained)
        spec.proposer.launch_chained = launches
    if hasattr(spec.proposer, "record_device_times"):
        spec.proposer.record_device_times = True
    device_times = getattr(spec.proposer, "device_times_ms", None)
    num_device_times = len(device_times) if device_times is not None else 0
    chained = core.num_chained_steps
    try:
        fast = run_engine_requests(core, prompts, params)
    finally:
        del spec.proposer.propose  # back to the class method
        if launches is not None:
            del spec.proposer.launch_chained
    chained = core.num_chained_steps - chained
    stats = spec.stats
    drafted = stats.num_draft_tokens - before.num_draft_tokens
    accepted = stats.num_accepted_tokens - before.num_accepted_tokens
    verifying = stats.num_verified_sequences - before.num_verified_sequences
    paused = stats.num_paused_sequence_steps - before.num_paused_sequence_steps
    emitted = stats.num_emitted_tokens - before.num_emitted_tokens
    mean_emitted = emitted / verifying if verifying else 1.0
    alpha = alpha_since(before, stats, k)
    # c: one draft token's proposer time per step over one plain decode step of the same batch.
    # Chained n-gram steps draft inside their verification's last kernel, not timed here: there
    # c counts the host proposer's time (steps that start a chain) spread over all steps, which
    # leaves the device proposer's kernel out of the theory's denominator (a stricter theory).
    # Chained draft-model steps count the host time of their draft launches too.
    num_steps = sum(1 for s in fast.steps if s["pure_decode"])
    host_s = sum(timer.durations) + (sum(launches.durations) if launches is not None else 0.0)
    per_step_s = host_s / max(num_steps, 1) if chained else timer.median_s
    host_per_step_s = per_step_s
    # A draft model whose drafts stay on the device returns before they are computed: its cost
    # is its device time, event-timed from where the stream reaches the draft's first step to its
    # last kernel. That span holds any wait for the host to enqueue the next draft step, so a
    # host-bound draft costs its host time there; the host's own time can also hold waits for an
    # earlier step (pinned staging sets), which are not the draft's cost: it is reported apart.
    draft_device = device_times[num_device_times:] if device_times is not None else []
    draft_device_ms = statistics.median(draft_device) if draft_device else None
    if draft_device_ms is not None:
        per_step_s = draft_device_ms / 1e3
    c = (per_step_s / k) / (base_step_ms / 1e3)
    theory = theoretical_speedup(alpha, k, c)
    base_ms, fast_ms = decode_ms_per_token(base), decode_ms_per_token(fast)
    base_req_ms, fast_req_ms = mean_request_ms_per_token(base), mean_request_ms_per_token(fast)
    measured = base_ms / fast_ms
    same = [prefix_fraction(a, b) for a, b in zip(base.token_ids, fast.token_ids, strict=True)]
    row = {
        "batch": len(prompts),
        "k": k,
        "identical_outputs": base.token_ids == fast.token_ids,
        "identical_prefix_fraction": round(statistics.mean(same), 4),
        "base_tok_s": round(base.output_tok_s, 2),
        "spec_tok_s": round(fast.output_tok_s, 2),
        "base_ms_per_token": round(base_ms, 3),
        "spec_ms_per_token": round(fast_ms, 3),
        "base_decode_step_ms": round(base_step_ms, 3),
        "base_steps_planned_ahead": base_ahead,  # async scheduling in the plain run
        # the device's idle share between steps (CUDA): a plain run near 0 is device-bound; one
        # well above is host-bound, and a chain that runs steps without the host gains on it.
        # A lower bound: a gap inside a step (the host late between the forward's launch and the
        # sampling's) counts as busy, as the runner's events bracket the whole step.
        "base_gpu_idle_fraction": gpu_idle_fraction(base),
        "spec_gpu_idle_fraction": gpu_idle_fraction(fast),
        "chained_steps": chained,  # device steps planned ahead that verified drafts made on the device
        # Where a speculative step's time goes (host phases of EngineCore.step; the draft model
        # and the n-gram proposer run in `update`, the target's verification in `collect`).
        "spec_step_ms": step_median(fast, len(prompts)),
        # the distribution's tail: a mean far above the median means a few slow steps
        "spec_step_ms_mean_max": step_mean_max(fast, len(prompts)),
        "base_step_ms_mean_max": step_mean_max(base, len(prompts)),
        "spec_phases_ms": phase_medians(fast, len(prompts)),
        "base_phases_ms": phase_medians(base, len(prompts)),
        "proposer_ms_per_step": round(timer.median_s * 1e3, 3),  # host time of a proposal
        "proposer_device_ms_per_step": None if draft_device_ms is None else round(draft_device_ms, 3),
        # the host's time a step (propose + chained draft launches); c with it instead, for reference
        "proposer_host_ms_per_step": round(host_per_step_s * 1e3, 3),
        "c_host": round((host_per_step_s / k) / (base_step_ms / 1e3), 4),
        # sequence-steps that verified drafts / that the policy had paused, and the tokens one
        # sequence gained per step while the batch was full (what the formula models)
        "verifying_sequence_steps": verifying,
        "paused_sequence_steps": paused,
        **draft_accounting(before, stats, fast),
        "full_batch_tokens_per_host_step": full_batch_tokens_per_host_step(fast, len(prompts)),
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "acceptance_ratio": round(accepted / drafted, 4) if drafted else 0.0,
        "mean_emitted_per_verify_step": round(mean_emitted, 3),
        "verified_emitted_tokens": emitted,
        "alpha": round(alpha, 4),
        "c": round(c, 4),
        "theoretical_speedup": round(theory, 3),
        "measured_speedup": round(measured, 3),
        "measured_over_theoretical": round(measured / theory, 3),
        # per request (TPOT, averaged over the requests): a request that finished early is not
        # charged for the steps of those still running, as it is in the whole-run figure above
        "base_request_ms_per_token": round(base_req_ms, 3),
        "spec_request_ms_per_token": round(fast_req_ms, 3),
        "request_speedup": round(base_req_ms / fast_req_ms, 3),
        "request_over_theoretical": round(base_req_ms / fast_req_ms / theory, 3),
        # the same over the steps with all B sequences running: what a continuously refilled batch
        # of B sees; the whole-run figure above also pays for the tail, where sequences that drew
        # fewer accepted drafts finish alone at a smaller batch
        "full_batch_steps": len(full_steps(fast, len(prompts))),
        "all_steps": sum(1 for s in fast.steps if s["pure_decode"]),
        # against the theory at the window's own alpha (acceptance varies over a response)
        **full_batch_columns(base, fast, len(prompts), k, c, theory),
        "step_trace": {"base": step_trace(base), "spec": step_trace(fast)},
    }
    # the same ratios against the theory at alpha over every sequence-step that asked for drafts
    # (`alpha_all_steps`: an n-gram step without a match counted as a draft rejected at once)
    row.update(all_steps_columns(row))
    return row


def refilled(core, pool: list[list[int]], batch: int, request_params: SamplingParams, speculate: bool):
    """Output lengths drawn per request (seeded: the same in both modes) from max_tokens / 2 to
    3 max_tokens / 2, as real traffic has them: plain decoding then also finishes and admits
    sequences at different steps, not all B at once."""
    rng = random.Random(len(pool))
    max_tokens = request_params.max_tokens
    params = [
        replace(
            request_params,
            max_tokens=rng.randint(max(2, max_tokens // 2), 3 * max_tokens // 2),
            use_speculation=speculate,
        )
        for _ in pool
    ]
    return run_engine_closed_loop(core, pool, params, batch)


def run_workload(
    w: Workload,
    batches: list[int],
    ks: list[int],
    max_tokens: int,
    num_blocks: int,
    refill: int = 0,
    rounds: int = 1,
    temperature: float = 0.0,
) -> list[dict]:
    """One row per (K, batch). Each row's plain run is measured right before its speculative run
    (not once per batch: the host's speed drifts over a run, and a plain step of a launch-bound
    model is host work); with rounds > 1 the pair is repeated and the round with the median
    measured / theoretical ratio among those with a device-bound plain run is the row (every
    round's ratio is recorded; fewer than half device-bound: as many rounds again). `temperature` > 0:
    every request samples, seeded (n-gram: the same tokens as plain decoding)."""
    core, rows = w.llm.core, []
    warm = w.prompts(1)
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        seed=1234 if temperature > 0 else None,
        ignore_eos=w.ignore_eos,
    )
    short = replace(params, max_tokens=8)
    for k in ks:
        set_speculation(w.llm, w.spec_config(k), num_blocks)
        baseline(core, warm, short)  # warm-up: allocator, kernels, first-call costs
        measure(core, warm, *baseline(core, warm, short), short, k)
        for batch in batches:
            prompts = w.prompts(batch)
            # Warm-up at this batch and K (kernels specialized or compiled on first use, the
            # draft's graphs): one-time costs stay out of the timed run.
            run_engine_requests(
                core, prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
            )
            trials = [
                measure(core, prompts, *baseline(core, prompts, params), params, k) for _ in range(rounds)
            ]
            if sum(map(device_bound, trials)) < (rounds + 1) // 2:  # a slow host phase: more rounds
                trials += [
                    measure(core, prompts, *baseline(core, prompts, params), params, k) for _ in range(rounds)
                ]
            row = median_round(trials)
            if refill:
                pool = w.prompts(refill * batch)
                plain_loop = refilled(core, pool, batch, params, False)
                before = replace(core.spec_decoder.stats)
                steps0, chained0 = core._step, core.num_chained_steps
                fast_loop = refilled(core, pool, batch, params, True)
                alpha = alpha_since(before, core.spec_decoder.stats, k)
                theory = theoretical_speedup(alpha, k, row["c"])
                row.update(refilled_row(plain_loop, fast_loop, alpha, theory))
                # host passes of the whole refilled run, and its device steps chained on the
                # device (a step that is not chained shows here)
                row["refilled_host_steps"] = core._step - steps0
                row["refilled_chained_steps"] = core.num_chained_steps - chained0
            rows.append(row)
            print(w.name, json.dumps(row), flush=True)
    return rows


# A plain run that left the device idle more than this share of the time was host-bound: its
# step is the host's Python, not the device's work, and a ratio against it says little about
# the speculative step (H100 / H200 hosts, 2026-12-06: idle 0.2-0.4 in some rounds, 0.02-0.08
# in the others, the plain step 1.0-1.6 ms instead of 0.75-1.05).
HOST_BOUND_IDLE = 0.1


def device_bound(trial: dict) -> bool:
    """Whether a round's plain run kept the device busy (always true off CUDA: no idle figure)."""
    idle = trial.get("base_gpu_idle_fraction")
    return idle is None or idle <= HOST_BOUND_IDLE


def median_round(trials: list[dict]) -> dict:
    """The round with the median measured / theoretical among those whose plain run was
    device-bound (all rounds if none was: then `baseline_host_bound`), every round's ratios and
    plain idle shares recorded in the row."""
    pool = [t for t in trials if device_bound(t)] or trials
    row = sorted(pool, key=lambda r: r["measured_over_theoretical"])[len(pool) // 2]
    row["rounds"] = len(trials)
    row["rounds_device_bound"] = sum(map(device_bound, trials))
    row["baseline_host_bound"] = not device_bound(row)
    row["rounds_measured_over_theoretical"] = [t["measured_over_theoretical"] for t in trials]
    row["rounds_full_batch_over_theoretical"] = [t["full_batch_over_theoretical"] for t in trials]
    row["rounds_full_batch_over_theoretical_all_steps"] = [
        t.get("full_batch_over_theoretical_all_steps") for t in trials
    ]
    row["rounds_base_gpu_idle_fraction"] = [t.get("base_gpu_idle_fraction") for t in trials]
    return row


def build_parser(description: str = __doc__) -> argparse.ArgumentParser:
    """The options of the workloads (bench/profile_spec.py adds its own to the same parser)."""
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto", help="dtype of the SmolLM2 workloads")
    parser.add_argument("--model", default="builtin://smollm2-135m", help="SmolLM2 for (a) / (c)")
    parser.add_argument("--workloads", default="ngram,pair", help="any of ngram, pair, selfdraft")
    parser.add_argument("--draft", default="self:layers=0-9,20-29", help="draft spec of selfdraft")
    parser.add_argument("--ks", default="4", help="K values, e.g. 2,4,6")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--num-blocks", type=int, default=512)
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=1024,
        help="also the block tables' width (graphs are captured at it)",
    )
    parser.add_argument("--draft-layers", type=int, default=2, help="pair: the draft is the first L layers")
    parser.add_argument("--target-agreement", type=float, default=0.8, help="pair: teacher-forced agreement")
    parser.add_argument("--prompt-len", type=int, default=128, help="pair: random prompt tokens")
    parser.add_argument("--smoke", action="store_true", help="pair at toy size (CPU check of the code)")
    parser.add_argument(
        "--refill",
        type=int,
        default=4,
        help="also run B x REFILL requests (output lengths drawn around --max-tokens) with B in flight, each finished one replaced; 0: off",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="plain + speculative runs per row (the median round by measured/theory is reported)",
    )
    parser.add_argument(
        "--min-acceptance-rate",
        type=float,
        default=None,
        help="the policy's pause threshold (0: never pause)",
    )
    parser.add_argument(
        "--device-chain",
        choices=("on", "off"),
        default="on",
        help="greedy: accept and draft on the device (prompt lookup, or the draft model), steps "
        "planned ahead (off: synchronous steps)",
    )
    parser.add_argument(
        "--async-scheduling",
        choices=("auto", "on", "off"),
        default="auto",
        help="plan steps ahead (auto: as the engine does, on CUDA; chained speculative steps need it)",
    )
    parser.add_argument(
        "--device-drafts",
        choices=("on", "off"),
        default="on",
        help="draft model (greedy, or sampled without penalties): drafts stay on the device and feed the verification there",
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="> 0: every request samples at it, seeded (0: greedy)",
    )
    parser.add_argument(
        "--ngram-match",
        choices=("folded", "exact"),
        default=SpeculativeConfig.ngram_match,
        help="n-gram: match tokens up to a leading space and letter case (folded), or exact ids",
    )
    parser.add_argument(
        "--device-chain-steps",
        type=int,
        default=SpeculativeConfig.device_chain_steps,
        help="n-gram, device chain: verification steps launched back to back per host pass",
    )
    return parser


def _parse_args() -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args()
    if args.refill == 1:
        parser.error("--refill must be 0 (off) or >= 2: with B prompts the batch is never refilled")
    return args


def main() -> None:
    args = _parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    ks = [int(k) for k in args.ks.split(",")]
    results: dict = {"machine": _machine(args), "workloads": {}}
    for name in args.workloads.split(","):
        start = time.perf_counter()
        try:
            w = pair_workload(args, ks) if name == "pair" else smollm2_workload(args, ks, name)
        except (ImportError, OSError, ValueError) as exc:  # ModelLoadError: no gguf, no SmolLM2 file
            print(f"{name}: skipped, the model could not be built: {type(exc).__name__}: {exc}", flush=True)
            results["workloads"][name] = {"skipped": f"{type(exc).__name__}: {exc}", "rows": []}
            continue
        rows = run_workload(
            w, batches, ks, args.max_tokens, args.num_blocks, args.refill, args.rounds, args.temperature
        )
        results["workloads"][name] = {
            **w.info,
            "rows": rows,
            "seconds": round(time.perf_counter() - start, 1),
        }
        del w
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "speculative.json").write_text(json.dumps(results, indent=2))
    (out / "speculative_summary.txt").write_text(summary(results))
    plot(results, out / "speculative.png")
    print(summary(results))


def _machine(args) -> dict:
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu"
    return {
        "device": device,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "smollm2_model": args.model,
        "ks": args.ks,
        "max_tokens": args.max_tokens,
        "greedy": args.temperature == 0,
        "temperature": args.temperature,
        "device_chain": args.device_chain,
        "device_chain_steps": args.device_chain_steps,
        "device_drafts": args.device_drafts,
        "async_scheduling": args.async_scheduling,
    }


if __name__ == "__main__":
    main()
