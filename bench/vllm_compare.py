"""One table, ours against vLLM 0.26 on the same GPU (issue 47), from the JSON the GPU run wrote:

  DIR/throughput_gpu.json       bench/throughput.py --peer-methods (ours)
  DIR/vllm/vllm_peer.json       ../shared/vllm-peer/vllm_peer.py, vLLM's defaults
  DIR/vllm_match/vllm_peer.json the same with --match-ours (256 sequences, 8,192 tokens a step)
  DIR/serving_vllm.json         bench/serving_vllm.py (vllm serve vs pagedinfer serve), optional

Offline rows: output tok/s (1,000 x ~N(512, 64) -> 256), single-stream decode ms/token and TTFT
(512-token prompt, idle engine), the batch-256 decode step. Ours is timed as the peer times vLLM
(bench/peer_methods.py: whole-request wall times), so each ratio compares one method; ours' own
per-step medians are listed beside. "speed" is ours / vLLM for tok/s and vLLM / ours for times:
above 1 means ours is faster. Writes OUT/vllm_compare.json, .png and _summary.txt (markdown).

    python3 bench/vllm_compare.py --dir OUTDIR --out OUTDIR
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (bench/ is not a package)

# (key, label, unit, higher_is_better)
METRICS = [
    ("offline_tok_s", "offline output tok/s (1,000 x ~512 -> 256)", "tok/s", True),
    ("single_ms_per_token", "single-stream decode (512-token prompt)", "ms/token", False),
    ("batch256_step_ms", "batch-256 decode step", "ms", False),
    ("ttft_ms", "TTFT, 512-token prompt, idle engine", "ms", False),
]


def _get(d: dict | None, *path):
    for key in path:
        if not isinstance(d, dict) or d.get(key) is None:
            return None
        d = d[key]
    return d


def ours_metrics(t: dict | None) -> dict:
    """Ours from bench/throughput.py's JSON (peer-method numbers where present)."""
    m = {k: None for k, *_ in METRICS}
    if not t:
        return m
    m["offline_tok_s"] = _get(t, "offline", "output_tok_s")
    m["single_ms_per_token"] = _get(t, "vllm_peer_methods", "single_stream", "ms_per_token")
    m["batch256_step_ms"] = _get(t, "vllm_peer_methods", "batch_decode", "decode_step_ms")
    m["ttft_ms"] = _get(t, "vllm_peer_methods", "single_stream", "ttft_ms")
    m["own_single_step_ms"] = _get(t, "decode_vs_floor", "single_stream", "median_step_ms")
    m["own_batch256_step_ms"] = _get(t, "decode_vs_floor", "batch256", "median_step_ms")
    return m


def vllm_metrics(v: dict | None) -> dict:
    """vLLM from vllm_peer.py's JSON (TTFT: median wall time of the 1-token runs)."""
    m = {k: None for k, *_ in METRICS}
    if not v:
        return m
    m["offline_tok_s"] = _get(v, "offline", "output_tok_s")
    m["single_ms_per_token"] = _get(v, "single_stream", "ms_per_token")
    m["batch256_step_ms"] = _get(v, "batch256_decode", "decode_step_ms")
    t1 = _get(v, "single_stream", "t1_s")
    m["ttft_ms"] = round(statistics.median(t1) * 1e3, 3) if t1 else None
    return m


def speed(ours: float | None, peer: float | None, higher_is_better: bool) -> float | None:
    """Above 1: ours is faster (more tok/s, or fewer ms)."""
    if not ours or not peer:
        return None
    return ours / peer if higher_is_better else peer / ours


def offline_rows(ours: dict, vllm: dict, match: dict) -> list[dict]:
    rows = []
    for key, label, unit, hib in METRICS:
        rows.append(
            {
                "metric": key,
                "label": label,
                "unit": unit,
                "ours": ours.get(key),
                "vllm": vllm.get(key),
                "speed_vs_vllm": speed(ours.get(key), vllm.get(key), hib),
                "vllm_match_ours": match.get(key),
                "speed_vs_vllm_match": speed(ours.get(key), match.get(key), hib),
            }
        )
    return rows


def serving_rows(s: dict | None) -> list[dict]:
    """Per N: each engine's HTTP row side by side."""
    if not s:
        return []
    by = {(r["mode"].partition("/")[2], r["concurrency"]): r for r in s.get("results", [])}
    rows = []
    for n in sorted({n for _, n in by}):
        o, v = by.get(("ours", n)), by.get(("vllm", n))
        row = {"concurrency": n}
        for name, r in (("ours", o), ("vllm", v)):
            for k in ("tokens_per_second", "ttft_p50", "ttft_p99", "itl_p50", "itl_p99"):
                row[f"{name}_{k}"] = r[k] if r else None
        row["speed_tok_s"] = speed(row["ours_tokens_per_second"], row["vllm_tokens_per_second"], True)
        rows.append(row)
    return rows


def _f(x, digits: int = 1) -> str:
    return "n/a" if x is None else f"{x:,.{digits}f}"


def _ratio(x) -> str:
    return "n/a" if x is None else f"{x:.2f}x"


def format_tables(result: dict) -> str:
    gpu = result.get("gpu") or "unknown GPU"
    lines = [
        f"# pagedinfer vs vLLM {result.get('vllm_version') or '?'} on {gpu}",
        "",
        "speed: ours / vLLM for tok/s, vLLM / ours for times (above 1: ours faster)",
        "",
        "| metric | unit | ours | vLLM (defaults) | speed | vLLM --match-ours | speed |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in result["offline"]:
        digits = 1 if r["unit"] == "tok/s" else 2
        lines.append(
            f"| {r['label']} | {r['unit']} | {_f(r['ours'], digits)} | {_f(r['vllm'], digits)} | "
            f"{_ratio(r['speed_vs_vllm'])} | {_f(r['vllm_match_ours'], digits)} | {_ratio(r['speed_vs_vllm_match'])} |"
        )
    own = result.get("ours_own_step_medians") or {}
    if any(v is not None for v in own.values()):
        lines += [
            "",
            f"ours' own median pure-decode step: batch 1 {_f(own.get('single'), 2)} ms, "
            f"batch 256 {_f(own.get('batch256'), 2)} ms",
        ]
    if result.get("serving"):
        lines += [
            "",
            "## served (OpenAI /v1/completions, streaming; TTFT / ITL in ms, client side)",
            "",
            "| N | ours tok/s | vLLM tok/s | speed | ours TTFT p50/p99 | vLLM TTFT p50/p99 | ours ITL p50/p99 | vLLM ITL p50/p99 |",
            "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for r in result["serving"]:
            ms = lambda k, r=r: _f(None if r[k] is None else r[k] * 1e3, 1)  # noqa: E731
            lines.append(
                f"| {r['concurrency']} | {_f(r['ours_tokens_per_second'])} | {_f(r['vllm_tokens_per_second'])} | "
                f"{_ratio(r['speed_tok_s'])} | {ms('ours_ttft_p50')} / {ms('ours_ttft_p99')} | "
                f"{ms('vllm_ttft_p50')} / {ms('vllm_ttft_p99')} | {ms('ours_itl_p50')} / {ms('ours_itl_p99')} | "
                f"{ms('vllm_itl_p50')} / {ms('vllm_itl_p99')} |"
            )
    for note in result.get("notes", []):
        lines.append(f"- {note}")
    return "\n".join(lines) + "\n"


def _load(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def compare(d: Path) -> dict:
    t = _load(d / "throughput_gpu.json")
    v = _load(d / "vllm" / "vllm_peer.json")
    vm = _load(d / "vllm_match" / "vllm_peer.json")
    s = _load(d / "serving_vllm.json")
    ours = ours_metrics(t)
    notes = [f"missing: {name}" for name, x in (("throughput_gpu.json", t), ("vllm/vllm_peer.json", v),
                                                 ("vllm_match/vllm_peer.json", vm), ("serving_vllm.json", s)) if x is None]  # fmt: skip
    for name, peer in (("vLLM", v), ("vLLM --match-ours", vm)):
        for phase, err in ((peer or {}).get("errors") or {}).items():
            notes.append(f"{name} {phase}: {err[:300]}")
    return {
        "benchmark": "vllm_compare",
        "gpu": (t or {}).get("device") or (v or {}).get("gpu"),
        "vllm_gpu": (v or {}).get("gpu"),
        "vllm_version": (v or vm or {}).get("vllm"),
        "versions": {
            "ours_torch": (t or {}).get("torch"),
            "vllm": (v or vm or {}).get("vllm"),
            "vllm_torch": (v or vm or {}).get("torch"),
            "transformers": (v or vm or {}).get("transformers"),
            "triton": (v or vm or {}).get("triton"),
        },
        "vllm_config": (v or {}).get("vllm_config"),
        "vllm_match_config": (vm or {}).get("vllm_config"),
        "offline": offline_rows(ours, vllm_metrics(v), vllm_metrics(vm)),
        "ours_own_step_medians": {
            "single": ours["own_single_step_ms"],
            "batch256": ours["own_batch256_step_ms"],
        },
        "serving": serving_rows(s),
        "serving_workload": (s or {}).get("workload"),
        "notes": notes,
    }


def plot(result: dict, path: Path) -> None:
    drawn = common.subplots(path, 1, 2, figsize=(12, 4.5))
    if drawn is None:
        return
    fig, (a1, a2) = drawn
    rows = result["offline"]
    x = range(len(rows))
    a1.bar([i - 0.2 for i in x], [r["speed_vs_vllm"] or 0 for r in rows], 0.4, label="vs vLLM defaults")
    a1.bar(
        [i + 0.2 for i in x], [r["speed_vs_vllm_match"] or 0 for r in rows], 0.4, label="vs vLLM --match-ours"
    )
    a1.axhline(1.0, color="gray", ls="--")
    a1.set_xticks(list(x), ["offline tok/s", "1-stream ms/tok", "b256 step", "TTFT"])
    a1.set_ylabel("speed, ours / vLLM (>1: ours faster)")
    a1.set_title(f"offline, {result.get('gpu')}")
    a1.legend()
    serving = result.get("serving") or []
    for name in ("ours", "vllm"):
        pts = [
            (r["concurrency"], r[f"{name}_tokens_per_second"])
            for r in serving
            if r[f"{name}_tokens_per_second"]
        ]
        if pts:
            a2.plot(*zip(*pts, strict=True), "o-", label=f"{name} serve")
    a2.set(
        xscale="log", xlabel="concurrent streaming clients", ylabel="output tok/s", title="served (HTTP/SSE)"
    )
    if serving:
        a2.legend()
    a2.grid(alpha=0.3)
    common.save(fig, path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", required=True, help="the GPU run's OUTDIR")
    p.add_argument("--out", default=None, help="default: --dir")
    args = p.parse_args(argv)
    out = Path(args.out or args.dir)
    out.mkdir(parents=True, exist_ok=True)
    result = compare(Path(args.dir))
    (out / "vllm_compare.json").write_text(json.dumps(result, indent=2))
    text = format_tables(result)
    (out / "vllm_compare_summary.txt").write_text(text)
    plot(result, out / "vllm_compare.png")
    print(text)
    return 0 if all(r["ours"] is not None and r["vllm"] is not None for r in result["offline"]) else 1


if __name__ == "__main__":
    sys.exit(main())
