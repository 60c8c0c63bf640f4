"""The model's Triton path (fused elementwise kernels + attention kernels) against its CPU path.

A tiny random Llama runs the same ragged prefill and decode steps with backend="triton" under
TRITON_INTERPRET=1 and with backend="reference"; logits and the KV caches must agree. This checks
the wiring the GPU takes (q layout into attention, cache slots, residual carrying) on the CPU.
The interpreter must be on before triton is imported, so the model runs in a subprocess: this
file run as a script.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")


def _tiny_model(dtype):
    import torch

    from pagedinfer.engine.config import ModelConfig
    from pagedinfer.engine.models.llama import LlamaForCausalLM

    config = ModelConfig(
        architecture="llama",
        vocab_size=64,
        hidden_size=48,
        intermediate_size=80,
        num_layers=2,
        num_heads=6,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        rope_theta=10000.0,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config, dtype, "cpu").requires_grad_(False)
    for name, p in model.named_parameters():
        p.normal_(1.0, 0.2) if name.endswith("norm.weight") else p.normal_(0.0, 0.2)
    return model


def _run(out_path: str) -> None:
    import torch

    from pagedinfer._native import BlockManager
    from pagedinfer.engine.models.testing import PagedRunner

    model = _tiny_model(torch.float32)
    result = {}
    for backend in ("triton", "reference"):
        runner = PagedRunner(model, BlockManager(16, 8, True), 16, 8)
        runner.backend = backend
        runner.add(0, list(range(3, 14)))  # 11 tokens: across a block boundary
        runner.add(1, [5, 9, 2])
        prefill = runner.step([0, 1], [11, 3])  # the extend kernel
        runner.append(0, 7)
        runner.append(1, 8)
        decode = runner.step([0, 1], [1, 1])  # the decode kernel
        caches = torch.stack([torch.stack(kv) for kv in runner.kv_caches])
        result[backend] = (prefill, decode, caches)
    diffs = {
        name: float((a - b).abs().max())
        for name, a, b in zip(
            ("prefill", "decode", "caches"), result["triton"], result["reference"], strict=True
        )
    }
    with open(out_path, "w") as f:
        json.dump(diffs, f)


def test_triton_model_path_matches_reference(tmp_path):
    out = tmp_path / "diffs.json"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, __file__, str(out)], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    diffs = json.loads(out.read_text())
    assert diffs["prefill"] < 1e-4 and diffs["decode"] < 1e-4 and diffs["caches"] < 1e-5, diffs


def test_compute_logits_without_upcast_keeps_the_gemm_dtype():
    import torch

    model = _tiny_model(torch.bfloat16)
    hidden = torch.randn(3, 48).bfloat16()
    raw = model.compute_logits(hidden, upcast=False)  # [3, vocab]
    assert raw.dtype == torch.bfloat16 and torch.equal(raw.float(), model.compute_logits(hidden))


if __name__ == "__main__":
    _run(sys.argv[1])
