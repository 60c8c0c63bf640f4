"""Decode speed with a JSON schema vs unconstrained, at batch 1 and 64, on the CPU and (when CUDA
is present) the GPU: SmolLM2-135M (the embedded model), greedy.

Each (device, batch) runs the same prompts twice: unconstrained (`ignore_eos`, exactly
`--max-tokens` tokens each) and constrained by a JSON schema whose documents are long (an
array of records without maxItems: most requests run to max_tokens too). The speed compared is
the steady state: batch / median step time over the decode steps that held the full batch
(a request that completes its document early leaves those out), plus the overall output tok/s;
medians of `--repeats` runs of each, alternated. Beside the ratio, the grammar's host cost per
step (mask fill + application: the sampling phases, constrained minus free) and its share of a
free step; on a shared CPU whole step times swing by 10-20% between runs, that cost does not.
The schema is compiled before timing (the server's LRU cache holds it after the first request).

    .venv/bin/python -P bench/structured_output.py --out bench/results            # CPU (+ GPU)
    .venv/bin/python -P bench/structured_output.py --devices cuda --out OUT       # GPU only
"""

from __future__ import annotations

import os
import sys

_BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _BENCH_DIR]

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

sys.path.append(_BENCH_DIR)  # last, for the bench helpers only
import common  # noqa: E402
from throughput_lib import run_engine_requests  # noqa: E402

from pagedinfer.engine.config import DeviceConfig, EngineConfig, SchedulerConfig  # noqa: E402
from pagedinfer.engine.llm import LLM  # noqa: E402
from pagedinfer.engine.sampling_params import SamplingParams  # noqa: E402
from pagedinfer.engine.structured.spec import StructuredOutput  # noqa: E402

SCHEMA = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 9999},
            "name": {"type": "string", "maxLength": 16},
            "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
            "score": {"type": "number", "minimum": 0, "maximum": 100},
        },
        "required": ["id", "name", "tags", "score"],
        "additionalProperties": False,
    },
}
PROMPT = "List many products as JSON records with id, name, tags and score."


def steady_tok_s(run, batch: int) -> float | None:
    """batch / median step time over the pure decode steps that held the full batch."""
    ms = [s["ms"] for s in run.steps if s["pure_decode"] and s["batch"] == batch]
    return round(batch / (statistics.median(ms) / 1e3), 2) if ms else None


def sampling_ms(run, batch: int) -> float | None:
    """Median host ms of the sampling phases (LM head, mask fill and application, sampler, and
    the wait for the samples) over the same steps: where a grammar's whole cost shows, and short
    enough to stay readable on a noisy shared CPU where whole step times are not."""
    ms = [
        s["phases_ms"]["launch_sampling"] + s["phases_ms"]["collect"]
        for s in run.steps
        if s["pure_decode"] and s["batch"] == batch and "phases_ms" in s
    ]
    return round(statistics.median(ms), 3) if ms else None


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return round(statistics.median(values), 2) if values else None


def measure(llm: LLM, batch: int, max_tokens: int, repeats: int) -> dict:
    prompt = llm.tokenizer.encode_chat([{"role": "user", "content": PROMPT}])
    free = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    spec = StructuredOutput.json_schema(SCHEMA, strict=True)
    constrained = SamplingParams(max_tokens=max_tokens, temperature=0.0, structured_output=spec)
    llm.core.validate(prompt, constrained)  # compile (and import xgrammar) before timing
    for params in (free, constrained):  # warm-up: the first steps of a fresh batch shape
        run_engine_requests(
            llm.core, [prompt] * batch, SamplingParams(**{**params.__dict__, "max_tokens": 4})
        )
    runs: dict[str, list] = {"unconstrained": [], "json_schema": []}
    for _ in range(repeats):  # alternated: a load change on a shared machine hits both alike
        for name, params in (("unconstrained", free), ("json_schema", constrained)):
            runs[name].append(run_engine_requests(llm.core, [prompt] * batch, params))
    out = {}
    for name, done in runs.items():
        out[name] = {
            "output_tokens": [r.output_tokens for r in done],
            "seconds": [round(r.seconds, 3) for r in done],
            "output_tok_s": round(statistics.median(r.output_tok_s for r in done), 2),
            "steady_tok_s": _median([steady_tok_s(r, batch) for r in done]),
            "sampling_ms": _median([sampling_ms(r, batch) for r in done]),
        }
    out["json_schema"]["sample"] = llm.tokenizer.decode(runs["json_schema"][0].token_ids[0])[:120]
    free_s, json_s = out["unconstrained"]["steady_tok_s"], out["json_schema"]["steady_tok_s"]
    out["steady_ratio"] = round(json_s / free_s, 4) if free_s and json_s else None
    out["overall_ratio"] = round(out["json_schema"]["output_tok_s"] / out["unconstrained"]["output_tok_s"], 4)
    # The grammar's host cost per step (sampling phases, constrained minus free) as a share of a
    # free step: on the CPU, where nothing overlaps, the step's cost without the noise of the rest.
    free_ms, json_ms = out["unconstrained"]["sampling_ms"], out["json_schema"]["sampling_ms"]
    if free_ms is not None and json_ms is not None and free_s:
        out["grammar_ms_per_step"] = round(json_ms - free_ms, 3)
        out["grammar_share_of_step"] = round((json_ms - free_ms) / (batch / free_s * 1e3), 4)
    return out


def plot(results: dict, path: Path) -> None:
    drawn = common.subplots(path, 1, 1, figsize=(7, 4))
    if drawn is None:
        return
    fig, ax = drawn
    labels, free, constrained = [], [], []
    for device, by_batch in results["runs"].items():
        for batch, r in by_batch.items():
            labels.append(f"{device}\nbatch {batch}")
            free.append(r["unconstrained"]["steady_tok_s"] or 0)
            constrained.append(r["json_schema"]["steady_tok_s"] or 0)
    x = range(len(labels))
    ax.bar([i - 0.2 for i in x], free, 0.4, label="unconstrained")
    ax.bar([i + 0.2 for i in x], constrained, 0.4, label="JSON schema")
    for i, (a, b) in enumerate(zip(free, constrained, strict=True)):
        if a:
            ax.text(i + 0.2, b, f"{b / a:.3f}x", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("decode tok/s (steady, full batch)")
    ax.set_title("SmolLM2-135M greedy: structured output vs unconstrained")
    ax.set_yscale("log")
    ax.legend()
    common.save(fig, path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--devices", nargs="+", default=None, help="cpu and/or cuda (default: cpu, + cuda if present)"
    )
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 64])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5, help="runs of each, alternated (medians)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    devices = args.devices or (["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"])
    results: dict = {"machine": platform.node(), "torch_threads": torch.get_num_threads(), "runs": {}}
    for device in devices:
        llm = LLM(
            EngineConfig(
                scheduler=SchedulerConfig(max_model_len=1024, max_num_seqs=max(args.batches)),
                device=DeviceConfig(device=device),
            )
        )
        results["runs"][device] = {}
        for batch in args.batches:
            r = measure(llm, batch, args.max_tokens, args.repeats)
            results["runs"][device][str(batch)] = r
            print(
                f"{device} batch {batch}: unconstrained {r['unconstrained']['steady_tok_s']} tok/s, "
                f"JSON schema {r['json_schema']['steady_tok_s']} tok/s, ratio {r['steady_ratio']} "
                f"(overall {r['overall_ratio']}); grammar host ms/step {r.get('grammar_ms_per_step')} "
                f"({r.get('grammar_share_of_step')} of a free step)",
                flush=True,
            )
        del llm
    print(json.dumps(results, indent=1))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        tag = "_".join(devices)
        (args.out / f"structured_output_{tag}.json").write_text(json.dumps(results, indent=1) + "\n")
        plot(results, args.out / f"structured_output_{tag}.png")


if __name__ == "__main__":
    main()
