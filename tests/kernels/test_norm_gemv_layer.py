"""The RMSNorm folded into the one-row GEMV (linear_ops.norm_linear), through whole decoder layers.

A tiny fp16 Llama (2 layers, hidden 64, 4 heads, 2 KV heads, intermediate 128) runs one decode
step (one token over 11 cached ones) on backend="triton" under TRITON_INTERPRET=1, once with the
fold on and once with linear_ops.NORM_GEMV_ENABLED off (PAGEDINFER_NORM_GEMV=0 is read once, at
import, into that constant). Each layer's block output and residual, the final hidden state and
the KV caches must agree. Spies (wrappers that call through) count the folded kernel's launches,
and a mutation run (one norm weight element off by 1/32 in the folded path only) must exceed the
tolerance, so the comparison can fail. The interpreter must be on before triton is imported, so
the step runs in a subprocess: this file run as a script. Results come back as JSON numbers.
"""

from __future__ import annotations

import json
import sys

import pytest

from tests.kernels.interpreter_run import run_interpreted

pytest.importorskip("triton")

CONTEXT = 11  # cached tokens before the decoded one; with block_size 8 they span two blocks
BLOCK_SIZE = 8
BLOCK_TABLE = [2, 0]  # not the identity: the slots must follow the table
# Fold on vs off, max |a - b| / max |b| per tensor: the two paths round the same fp16 steps and
# differ only in the order of fp32 sums, so about one fp16 ulp of the largest value (2^-10) may
# move (0.0 measured under the interpreter at this shape).
TOLERANCE = 2.0**-10
# Either Triton path vs backend="reference" (PyTorch fp16 on the CPU): an anchor, not the subject
# (<= 9.4e-4 measured).
REFERENCE_TOLERANCE = 5e-3
# One norm weight element off by 2^-5 in the folded path only: ~3x TOLERANCE in layer 1's output.
MUTATION = 2.0**-5


def _tiny_model():
    import torch

    from pagedinfer.engine.config import ModelConfig
    from pagedinfer.engine.models.llama import LlamaForCausalLM

    config = ModelConfig(
        architecture="llama",
        vocab_size=32,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config, torch.float16, "cpu").requires_grad_(False)
    for name, p in model.named_parameters():
        # Norm weights far from 1 and embeddings far from unit RMS: the norm must act.
        if name.endswith("norm.weight"):
            p.copy_(1.0 + 0.5 * torch.randn(p.shape))
        elif "embed" in name:
            p.copy_(3.0 * torch.randn(p.shape))
        else:
            p.copy_(torch.randn(p.shape) / p.shape[-1] ** 0.5)
    return model


def _decode_step(model, caches, backend: str):
    """One token at position CONTEXT -> ({name: fp32 tensor}) of every layer's (hidden, residual)."""
    import torch

    from pagedinfer.engine.worker.attn_metadata import AttentionMetadata

    position = CONTEXT
    slot = BLOCK_TABLE[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE
    md = AttentionMetadata(
        slot_mapping=torch.tensor([slot]),
        positions=torch.tensor([position]),
        block_tables=torch.tensor([BLOCK_TABLE], dtype=torch.int32),
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
        seq_lens=torch.tensor([CONTEXT + 1], dtype=torch.int32),
        logits_indices=torch.tensor([0]),
        max_query_len=1,
        max_seq_len=CONTEXT + 1,
        is_pure_decode=True,
        backend=backend,
    )
    outputs = {}

    def capture(i):
        def hook(module, args, out):
            outputs[f"layer{i}_hidden"], outputs[f"layer{i}_residual"] = (t.float().clone() for t in out)

        return hook

    handles = [layer.register_forward_hook(capture(i)) for i, layer in enumerate(model.model.layers)]
    try:
        with torch.inference_mode():
            final = model(torch.tensor([5]), md.positions, caches, md)  # [1, hidden]
    finally:
        for h in handles:
            h.remove()
    outputs["final_hidden"] = final.float()
    outputs["kv_caches"] = torch.stack([torch.stack(kv) for kv in caches]).float()
    return outputs


def _spy(mp, module, name: str, calls: list, mutate=None) -> None:
    """Wrap module.name (it still runs); record for each call that returned whether its second
    argument (add_norm_gemv's residual) was given; `mutate(index, args)` may perturb the call."""
    original = getattr(module, name)

    def wrapper(*args, **kwargs):
        if mutate is not None:
            args = mutate(len(calls), args)
        out = original(*args, **kwargs)
        calls.append(args[1] is not None)
        return out

    mp.setattr(module, name, wrapper)


def _perturb_last_norm(index: int, args: tuple) -> tuple:
    # The 4th fold of the step: layer 1's post-attention norm (reaches only layer1_hidden and after).
    if index != 3:
        return args
    norm_weight = args[2].clone()
    norm_weight[7] *= 1.0 + MUTATION
    return (*args[:2], norm_weight, *args[3:])


def _run_path(model, caches, fold: bool, mutate=None) -> tuple[dict, dict]:
    from pagedinfer.kernels import fused_ops, linear_ops, norm_gemv

    calls = {"add_norm_gemv": [], "rms_norm": [], "add_rms_norm": []}
    with pytest.MonkeyPatch.context() as mp:
        # The subprocess runs without PAGEDINFER_* variables; pin the switches the fold needs.
        mp.setattr(linear_ops, "GEMV_ENABLED", True)
        mp.setattr(fused_ops, "FUSED_KERNELS_ENABLED", True)
        mp.setattr(linear_ops, "NORM_GEMV_ENABLED", fold)
        _spy(mp, norm_gemv, "add_norm_gemv", calls["add_norm_gemv"], mutate)
        _spy(mp, fused_ops, "rms_norm", calls["rms_norm"])
        _spy(mp, fused_ops, "add_rms_norm", calls["add_rms_norm"])
        outputs = _decode_step(model, [tuple(t.clone() for t in kv) for kv in caches], "triton")
    return outputs, calls


def _rel_diffs(a: dict, b: dict) -> dict[str, float]:
    return {k: float((a[k] - b[k]).abs().max() / b[k].abs().max()) for k in b}


def _model_and_caches():
    """The tiny model and 3 blocks of KV cache a layer with random K/V (the earlier tokens')."""
    import torch

    from pagedinfer.engine.worker.kv_cache import allocate_kv_caches

    model = _tiny_model()
    caches = allocate_kv_caches(model.config, 3, BLOCK_SIZE, "cpu", torch.float16)
    for kv in caches:  # the CONTEXT earlier tokens' K/V (other slots are never read)
        for t in kv:
            t.copy_(torch.randn(t.shape))
    return model, caches


def _run(out_path: str) -> None:
    import torch

    model, caches = _model_and_caches()
    folded, folded_calls = _run_path(model, caches, fold=True)
    two_step, two_step_calls = _run_path(model, caches, fold=False)
    mutated, _ = _run_path(model, caches, fold=True, mutate=_perturb_last_norm)
    reference = _decode_step(model, [tuple(t.clone() for t in kv) for kv in caches], "reference")
    result = {
        "fold_vs_two_step": _rel_diffs(folded, two_step),
        "mutated_vs_two_step": _rel_diffs(mutated, two_step),
        "fold_vs_reference": _rel_diffs(folded, reference),
        "two_step_vs_reference": _rel_diffs(two_step, reference),
        "calls": {"fold": folded_calls, "two_step": two_step_calls},
        "residual_exact": {
            k: bool(torch.equal(folded[k], two_step[k])) for k in folded if k.endswith("residual")
        },
    }
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("norm_gemv_layer") / "results.json"
    return run_interpreted("tests.kernels.test_norm_gemv_layer", out, without_switches=True)


def test_the_folded_kernel_ran_for_every_norm_of_the_layers(results):
    fold, two_step = results["calls"]["fold"], results["calls"]["two_step"]
    # Two norms per layer, all folded; the first layer's input norm has no residual yet.
    assert fold["add_norm_gemv"] == [False, True, True, True]
    assert fold["rms_norm"] == [] and len(fold["add_rms_norm"]) == 1  # only the model's final norm
    assert two_step["add_norm_gemv"] == []
    assert len(two_step["rms_norm"]) == 1 and len(two_step["add_rms_norm"]) == 4


def test_folded_layers_match_the_two_step_path(results):
    diffs = results["fold_vs_two_step"]
    assert set(diffs) >= {"layer0_hidden", "layer1_residual", "final_hidden", "kv_caches"}
    assert max(diffs.values()) <= TOLERANCE, diffs
    # The first residual is the embedding itself and the next one x + residual rounded once.
    assert results["residual_exact"]["layer0_residual"], results["residual_exact"]


def test_both_triton_paths_stay_near_the_reference_backend(results):
    for key in ("fold_vs_reference", "two_step_vs_reference"):
        assert max(results[key].values()) <= REFERENCE_TOLERANCE, (key, results[key])


def test_a_wrong_norm_weight_in_the_fold_fails_the_comparison(results):
    diffs = results["mutated_vs_two_step"]
    assert diffs["layer1_hidden"] > TOLERANCE, diffs
    # The perturbed norm feeds only layer 1's MLP: what came before it is untouched.
    assert diffs["layer0_hidden"] <= TOLERANCE and diffs["layer1_residual"] <= TOLERANCE, diffs


if __name__ == "__main__":
    _run(sys.argv[1])
