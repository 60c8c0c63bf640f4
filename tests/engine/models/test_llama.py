"""Logit parity with Hugging Face transformers through the real paged path.

Tiny random Llama / Llama-3-rope / Qwen2 / Mistral checkpoints are saved with save_pretrained
(safetensors) and loaded with our loader; our model runs ragged batches over the native block
manager's slot mappings and block tables, and every computed row is compared against HF's
full-sequence forward (causality makes row p depend only on tokens <= p).

Tolerances: fp32 max |diff| <= 1e-4 on logits of magnitude ~5; against HF fp32, bf16 <= 0.2
(measured 0.10) and fp16 <= 0.03 (measured 0.011).
"""

from __future__ import annotations

import pytest
import torch
from hf_tiny import VARIANTS, hf_logits

from pagedinfer._native import BlockManager
from pagedinfer.engine.models.loader import load_model
from pagedinfer.engine.models.testing import PagedRunner

FP32_ATOL = 1e-4
BF16_ATOL = 0.2
FP16_ATOL = 0.03
BLOCK_SIZE = 16
NUM_BLOCKS = 64
VOCAB = 384


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _runner(folder, dtype=torch.float32) -> PagedRunner:
    loaded = load_model(str(folder), "cpu", dtype)
    return PagedRunner(loaded.model, BlockManager(NUM_BLOCKS, BLOCK_SIZE, True), NUM_BLOCKS, BLOCK_SIZE)


def _assert_close(ours: torch.Tensor, ref: torch.Tensor, atol: float) -> None:
    diff = (ours - ref).abs().max().item()
    print(f"max abs logit diff {diff:.3g} (atol {atol})")
    assert diff <= atol, f"max abs logit diff {diff:.3g} > {atol}"


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_ragged_prefill_matches_hf(tiny_checkpoint, variant):
    hf, folder = tiny_checkpoint(variant)
    runner = _runner(folder)
    # Odd lengths, lengths at one and two block boundaries, across them, and a single token.
    lengths = [17, 16, 32, 33, 5, 1]
    seqs = [_tokens(n, seed=i) for i, n in enumerate(lengths)]
    for seq_id, seq in enumerate(seqs):
        runner.add(seq_id, seq)
    logits = runner.step(list(range(len(seqs))), lengths)  # one step, 104 tokens, no padding
    _assert_close(logits, torch.cat([hf_logits(hf, s) for s in seqs]), FP32_ATOL)


@pytest.mark.parametrize("variant", ["llama-gqa", "qwen2"])
def test_chunked_prefill_and_mixed_decode_match_hf(tiny_checkpoint, variant):
    """Step 1: A prefills; then A decodes while B prefills in chunks of 7 in the same steps;
    then both decode together (the pure-decode kernel), crossing a block boundary."""
    hf, folder = tiny_checkpoint(variant)
    runner = _runner(folder)
    full_a, full_b = _tokens(24, seed=10), _tokens(30, seed=11)  # prompt + forced continuation
    runner.add(0, full_a[:14])
    runner.add(1, full_b[:19])
    rows = {0: [runner.step([0], [14])], 1: []}
    for step in range(3):  # mixed: A decodes one token, B prefills a 7/7/5 chunk
        runner.append(0, full_a[14 + step])
        chunk = min(7, 19 - 7 * step)
        logits = runner.step([0, 1], [1, chunk])
        rows[0].append(logits[:1])
        rows[1].append(logits[1:])
    assert runner.num_computed == {0: 17, 1: 19}
    for step in range(7):  # pure decode of both
        runner.append(0, full_a[17 + step])
        runner.append(1, full_b[19 + step])
        logits = runner.step([0, 1], [1, 1])
        rows[0].append(logits[:1])
        rows[1].append(logits[1:])
    _assert_close(torch.cat(rows[0]), hf_logits(hf, full_a), FP32_ATOL)
    _assert_close(torch.cat(rows[1]), hf_logits(hf, full_b[:26]), FP32_ATOL)


def test_prefix_cache_hit_reuses_blocks_and_matches_hf(tiny_checkpoint):
    hf, folder = tiny_checkpoint("llama-gqa")
    runner = _runner(folder)
    shared = _tokens(40, seed=20)
    runner.add(0, shared)
    runner.step([0], [40])  # caches the two full blocks of the shared prefix
    second = shared[:37] + _tokens(6, seed=21)
    assert runner.add(1, second) == 2 * BLOCK_SIZE  # 32 tokens served from A's blocks
    logits = runner.step([1], [len(second) - 2 * BLOCK_SIZE])
    _assert_close(logits, hf_logits(hf, second)[2 * BLOCK_SIZE :], FP32_ATOL)
    # A full hit (same prompt again) recomputes only the last token.
    assert runner.add(2, shared[:32]) == 32
    _assert_close(runner.step([2], [1]), hf_logits(hf, shared[:32])[31:], FP32_ATOL)


def test_speculative_style_multi_token_verification(tiny_checkpoint):
    """A sequence with cached context scoring 4 draft tokens at once next to a decode sequence."""
    hf, folder = tiny_checkpoint("llama3-rope")
    runner = _runner(folder)
    a, b = _tokens(45, seed=30), _tokens(9, seed=31)
    runner.add(0, a[:41])
    runner.add(1, b[:8])
    runner.step([0, 1], [41, 8])
    for token in a[41:]:
        runner.append(0, token)
    runner.append(1, b[8])
    logits = runner.step([0, 1], [4, 1])
    _assert_close(logits[:4], hf_logits(hf, a)[41:], FP32_ATOL)
    _assert_close(logits[4:], hf_logits(hf, b)[8:], FP32_ATOL)


@pytest.mark.parametrize("dtype, atol", [(torch.bfloat16, BF16_ATOL), (torch.float16, FP16_ATOL)], ids=str)
def test_half_precision_close_to_hf_fp32(tiny_checkpoint, dtype, atol):
    hf, folder = tiny_checkpoint("llama-gqa")
    runner = _runner(folder, dtype)
    assert runner.model.dtype == dtype and runner.kv_caches[0][0].dtype == dtype
    seqs = [_tokens(n, seed=40 + n) for n in (23, 9)]
    for seq_id, seq in enumerate(seqs):
        runner.add(seq_id, seq)
    logits = runner.step([0, 1], [23, 9])
    assert logits.dtype == torch.float32
    _assert_close(logits, torch.cat([hf_logits(hf, s) for s in seqs]), atol)
    runner.append(0, 7)
    runner.append(1, 8)
    decode = runner.step([0, 1], [1, 1])
    _assert_close(
        decode, torch.stack([hf_logits(hf, s + [t])[-1] for s, t in zip(seqs, (7, 8), strict=True)]), atol
    )


def test_forward_rejects_wrong_number_of_caches(tiny_checkpoint):
    _, folder = tiny_checkpoint("llama-gqa")
    runner = _runner(folder)
    runner.add(0, [1, 2, 3])
    runner.kv_caches = runner.kv_caches[:1]
    with pytest.raises(ValueError, match="KV caches for 2 layers"):
        runner.step([0], [3])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_cuda_bfloat16_close_to_hf_fp32(tiny_checkpoint, backend):
    """GPU counterpart of test_half_precision_close_to_hf_fp32 (same tolerance), per attention backend."""
    hf, folder = tiny_checkpoint("llama-gqa")
    loaded = load_model(str(folder), "cuda", torch.bfloat16)
    runner = PagedRunner(loaded.model, BlockManager(NUM_BLOCKS, BLOCK_SIZE, True), NUM_BLOCKS, BLOCK_SIZE)
    runner.backend = backend
    seqs = [_tokens(n, seed=40 + n) for n in (23, 9)]
    for seq_id, seq in enumerate(seqs):
        runner.add(seq_id, seq)
    prefill = runner.step([0, 1], [23, 9]).cpu()
    _assert_close(prefill, torch.cat([hf_logits(hf, s) for s in seqs]), BF16_ATOL)
    extra = [_tokens(1, seed=50)[0], _tokens(1, seed=51)[0]]
    for seq_id, token in enumerate(extra):
        runner.append(seq_id, token)
    decode = runner.step([0, 1], [1, 1]).cpu()  # the pure-decode kernel
    ref = torch.stack([hf_logits(hf, s + [t])[-1] for s, t in zip(seqs, extra, strict=True)])
    _assert_close(decode, ref, BF16_ATOL)
