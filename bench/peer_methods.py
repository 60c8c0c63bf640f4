"""Our engine timed the way the vLLM peer times itself (../shared/vllm-peer/vllm_peer.py), so that
bench/vllm_compare.py compares like with like (issue 47). Each number is the wall time of whole
requests on an idle engine, as vLLM's `llm.generate` is timed:

  ttft          one 512-token prompt (seed 9), 1 output token: add -> finished, median of `reps`;
  single_stream (t(256 out) - t(1 out)) / 255 on the same prompt, medians of `reps` runs each;
  batch256      256 x 512-token prompts (seed 7): (t(N2 out) - t(N1 out)) / (N2 - N1), best of 2
                each, N1 = prefill steps at the step's token budget + 8, N2 = N1 + 64: both runs
                share the prefill ramp, so the difference is N2 - N1 pure batch-256 decode steps.

bench/throughput.py calls `measure` after its own runs (`--peer-methods`).
"""

from __future__ import annotations

import statistics

from throughput_lib import run_engine_requests

from pagedinfer.engine.sampling_params import SamplingParams


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def ttft_and_single_stream(core, prompt: list[int], output_len: int, reps: int = 3) -> dict:
    """Time to first token and ms/token of one stream, both from whole-request wall times."""
    t1, t_full = [], []
    for _ in range(reps):
        run = run_engine_requests(core, [prompt], _greedy(1))
        assert run.output_tokens == 1, run.output_tokens
        t1.append(run.seconds)
        run = run_engine_requests(core, [prompt], _greedy(output_len))
        assert run.output_tokens == output_len, run.output_tokens
        t_full.append(run.seconds)
    ms = (statistics.median(t_full) - statistics.median(t1)) / (output_len - 1) * 1e3
    return {
        "prompt_len": len(prompt),
        "output_len": output_len,
        "t1_s": [round(x, 4) for x in t1],
        f"t{output_len}_s": [round(x, 4) for x in t_full],
        "ttft_ms": round(statistics.median(t1) * 1e3, 3),
        "ms_per_token": round(ms, 3),
        "ms_per_token_best": round((min(t_full) - min(t1)) / (output_len - 1) * 1e3, 3),
    }


def batch_decode_step(core, prompts: list[list[int]], max_num_batched_tokens: int) -> dict:
    """The batch's decode step from two run lengths sharing one prefill ramp (vLLM's method)."""
    total = sum(len(p) for p in prompts)
    prefill_steps = -(-total // max_num_batched_tokens) + 1
    n1 = max(16, prefill_steps + 8)
    n2 = n1 + 64
    ta, tb = [], []
    for _ in range(2):
        ta.append(run_engine_requests(core, prompts, _greedy(n1)).seconds)
        tb.append(run_engine_requests(core, prompts, _greedy(n2)).seconds)
    step = (min(tb) - min(ta)) / (n2 - n1) * 1e3
    return {
        "batch": len(prompts),
        "n1": n1,
        "n2": n2,
        f"t{n1}_s": [round(x, 4) for x in ta],
        f"t{n2}_s": [round(x, 4) for x in tb],
        "decode_step_ms": round(step, 3),
        "decode_tok_s": round(len(prompts) / step * 1e3, 1),
    }


def measure(
    core, single_prompt: list[int], batch_prompts: list[list[int]], output_len: int, budget: int
) -> dict:
    """All three, in the peer's order (single stream first, then the batch)."""
    return {
        "single_stream": ttft_and_single_stream(core, single_prompt, output_len),
        "batch_decode": batch_decode_step(core, batch_prompts, budget),
    }
