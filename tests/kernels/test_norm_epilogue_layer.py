"""The norm carried by GEMV epilogues (linear_residual -> norm_linear), through whole decoder layers.

The tiny fp16 Llama of test_norm_gemv_layer (2 layers, hidden 64) runs one extend step (3 new
tokens over 11 cached ones) on backend="triton" under TRITON_INTERPRET=1, once with the epilogue
path and once with it off (the norm kernel before each 3-row GEMV). The engine takes the path in
bf16 only (the interpreter's bf16 is broken), so fp16 is let in for this run. Spies count the
epilogue kernels; the final hidden state, each layer's residual stream and the KV caches must
agree within a tolerance, and a mutation (the norm weight one epilogue applies off by 1/16) must
exceed it. Run as a subprocess: the interpreter must be on before triton is imported.
"""

from __future__ import annotations

import json
import sys

import pytest

from tests.kernels.interpreter_run import run_interpreted

pytest.importorskip("triton")

CONTEXT, NEW_TOKENS, BLOCK_SIZE = 11, 3, 8
BLOCK_TABLE = [2, 0]
# Epilogue vs norm kernel, max |a - b| / max |b| per tensor: h * g is rounded once instead of
# x_hat and x_hat * g, so a few fp16 ulps of the largest value may move (8.9e-4 measured).
TOLERANCE = 2.0**-9
MUTATION = 2.0**-4


def _extend_step(model, caches, backend: str) -> dict:
    import torch

    from pagedinfer.engine.worker.attn_metadata import AttentionMetadata

    positions = list(range(CONTEXT, CONTEXT + NEW_TOKENS))
    slots = [BLOCK_TABLE[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in positions]
    md = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        positions=torch.tensor(positions),
        block_tables=torch.tensor([BLOCK_TABLE], dtype=torch.int32),
        query_start_loc=torch.tensor([0, NEW_TOKENS], dtype=torch.int32),
        seq_lens=torch.tensor([CONTEXT + NEW_TOKENS], dtype=torch.int32),
        logits_indices=torch.tensor([NEW_TOKENS - 1]),
        max_query_len=NEW_TOKENS,
        max_seq_len=CONTEXT + NEW_TOKENS,
        is_pure_decode=False,
        backend=backend,
    )
    outputs = {}

    def capture(i):
        def hook(module, args, out):
            hidden, residual = out
            # The stream after the layer: h inside a Prenormed, else block output + residual.
            stream = hidden.h if residual is None else hidden.float() + residual.float()
            outputs[f"layer{i}_stream"] = stream.float().clone()

        return hook

    handles = [layer.register_forward_hook(capture(i)) for i, layer in enumerate(model.model.layers)]
    try:
        with torch.inference_mode():
            final = model(torch.tensor([5, 9, 17]), md.positions, caches, md)
    finally:
        for h in handles:
            h.remove()
    outputs["final_hidden"] = final.float()
    outputs["kv_caches"] = torch.stack([torch.stack(kv) for kv in caches]).float()
    return outputs


def _run_path(model, caches, on: bool, mutate: bool = False) -> tuple[dict, dict]:
    import torch

    from pagedinfer.kernels import fused_ops, linear_ops, norm_epilogue

    calls = {"add_prenorm": 0, "rstd_linear": 0}
    add_prenorm, rstd_linear = norm_epilogue.add_prenorm, norm_epilogue.rstd_linear

    def spy_add(x, weight, residual, norm_weight, config):
        calls["add_prenorm"] += 1
        if mutate and calls["add_prenorm"] == 2:  # layer 0's down: the norm of layer 1's qkv
            norm_weight = norm_weight * (1.0 + MUTATION)
        return add_prenorm(x, weight, residual, norm_weight, config)

    def spy_rstd(*args, **kwargs):
        calls["rstd_linear"] += 1
        return rstd_linear(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(linear_ops, "GEMV_ENABLED", True)
        mp.setattr(fused_ops, "FUSED_KERNELS_ENABLED", True)
        mp.setattr(linear_ops, "NORM_EPILOGUE_ENABLED", on)
        mp.setattr(linear_ops, "NORM_EPILOGUE_DTYPES", (torch.float16,))
        mp.setattr(norm_epilogue, "add_prenorm", spy_add)
        mp.setattr(norm_epilogue, "rstd_linear", spy_rstd)
        outputs = _extend_step(model, [tuple(t.clone() for t in kv) for kv in caches], "triton")
    return outputs, calls


def _run(out_path: str) -> None:
    from tests.kernels.test_norm_gemv_layer import _model_and_caches, _rel_diffs

    model, caches = _model_and_caches()
    on, on_calls = _run_path(model, caches, on=True)
    off, off_calls = _run_path(model, caches, on=False)
    mutated, _ = _run_path(model, caches, on=True, mutate=True)
    result = {
        "on_vs_off": _rel_diffs(on, off),
        "mutated_vs_off": _rel_diffs(mutated, off),
        "calls": {"on": on_calls, "off": off_calls},
    }
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("norm_epilogue_layer") / "results.json"
    return run_interpreted("tests.kernels.test_norm_epilogue_layer", out, without_switches=True)


def test_the_epilogues_carry_every_norm_but_the_first_and_the_last(results):
    # 2 layers: o_proj of each layer and layer 0's down carry the next norm (3); the first input
    # norm (no GEMV before it) and the model's final norm stay kernels.
    assert results["calls"]["on"] == {"add_prenorm": 3, "rstd_linear": 3}
    assert results["calls"]["off"] == {"add_prenorm": 0, "rstd_linear": 0}


def test_the_epilogue_path_matches_the_norm_kernel_path(results):
    diffs = results["on_vs_off"]
    assert set(diffs) >= {"layer0_stream", "layer1_stream", "final_hidden", "kv_caches"}
    assert max(diffs.values()) <= TOLERANCE, diffs


def test_a_wrong_norm_weight_in_an_epilogue_fails_the_comparison(results):
    diffs = results["mutated_vs_off"]
    assert diffs["kv_caches"] > TOLERANCE and diffs["final_hidden"] > TOLERANCE, diffs
    assert diffs["layer0_stream"] <= TOLERANCE, diffs  # the stream before it is untouched


if __name__ == "__main__":
    _run(sys.argv[1])
