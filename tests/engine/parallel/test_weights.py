"""engine/parallel/weights.py: each rank's slices equal the same slices of the whole tensors.

GGUF (the embedded SmolLM2, Q4_1): row slices of quantized rows, column slices of whole
quantization blocks, Q/K un-permuted per head; safetensors: memory-mapped get_slice.
"""

from __future__ import annotations

import itertools

import torch

from pagedinfer.engine.models.loader import plan_model_load
from pagedinfer.engine.parallel.plan import ShardPlan
from pagedinfer.engine.parallel.weights import shard_weights

NUM_TENSORS = 12  # the global tensors and the first layer's, in file order


def _expected(full: torch.Tensor, plan: ShardPlan, name: str) -> torch.Tensor:
    piece = plan.weight_slice(name)
    if piece is None:
        return full
    part = full[piece.start : piece.end] if piece.dim == 0 else full[:, piece.start : piece.end]
    if piece.pad_to is not None and part.shape[0] < piece.pad_to:
        part = torch.cat([part, part.new_zeros((piece.pad_to - part.shape[0], *part.shape[1:]))])
    return part


def _check(uri: str, tp: int) -> set[str]:
    load = plan_model_load(uri)
    full = dict(itertools.islice(load.weights(), NUM_TENSORS))
    seen = set()
    for rank in range(tp):
        plan = ShardPlan(load.model_config, tp, rank)
        for name, tensor in itertools.islice(shard_weights(load.checkpoint, plan), NUM_TENSORS):
            torch.testing.assert_close(tensor, _expected(full[name], plan, name), rtol=0, atol=0)
            seen.add(name)
    return seen


def test_gguf_shards_equal_slices_of_the_whole():
    seen = _check("builtin://smollm2-135m", 3)
    assert {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight"} <= seen


def test_safetensors_shards_equal_slices_of_the_whole(tiny_llama_dir):
    seen = _check(str(tiny_llama_dir), 2)
    assert "lm_head.weight" in seen and "model.layers.0.self_attn.o_proj.weight" in seen
