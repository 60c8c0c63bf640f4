#!/usr/bin/env bash
# One command for the GPU machine: build, GPU correctness checks, then every GPU benchmark.
#
#   bench/run_gpu.sh OUTDIR
#
# Works on a bare H200 machine without network (python3 3.12 with torch, triton, transformers,
# pybind11, scikit-build-core, cmake, ninja): pure-Python wheels the project needs beyond those
# come from the git-ignored folder .whl/ (fill it here with bench/fetch_gpu_wheels.sh; see
# bench/gpu_requirements.md). Writes logs, JSON, plots and OUTDIR/SUMMARY.md. Budget: < 9 min.
# Each step is one `step NAME COMMAND...` line below (diagnostic probes: `probe NAME COMMAND...`,
# run only when asked for); a failing step is recorded and the rest still run; the script exits
# non-zero if any step failed.
set -uo pipefail
OUTDIR=$(realpath -m "${1:?usage: bench/run_gpu.sh OUTDIR}")
cd "$(dirname "$0")/.." || exit 1
mkdir -p "$OUTDIR"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
FAILED=()
SUMMARY="$OUTDIR/SUMMARY.md"
echo "# GPU run $(date -u +%FT%TZ)" >"$SUMMARY"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >>"$SUMMARY" 2>&1 || true

# STEPS="a b ..." runs only the named steps (plus wheels/build/versions), e.g. to split one run
# over two machine calls; unset runs everything.
STEPS=${STEPS:-}
step() {  # step NAME COMMAND... : log to OUTDIR/NAME.log, time it, record the status
  local name=$1 start rc
  shift
  if [[ -n $STEPS && $name != wheels && $name != build && $name != versions && " $STEPS " != *" $name "* ]]; then
    return 0
  fi
  start=$(date +%s)
  echo "== $name: $*"
  "$@" >"$OUTDIR/$name.log" 2>&1
  rc=$?
  tail -n 25 "$OUTDIR/$name.log"
  echo "- $name: rc=$rc, $(($(date +%s) - start)) s" >>"$SUMMARY"
  [[ $rc -eq 0 ]] || FAILED+=("$name")
  return 0
}

# PROBES="a b ..." (or "all") adds diagnostic probes: measurements that explain a benchmark's
# numbers (profiles, GEMM paths, peer sweeps) but are not themselves an issue's benchmark; they
# stay out of the default run to keep it under 9 minutes. A probe named in STEPS runs as well.
PROBES=${PROBES:-}
probe() {  # probe NAME COMMAND... : a step that runs only when named in PROBES or STEPS
  local name=$1
  if [[ " $PROBES " != *" all "* && " $PROBES " != *" $name "* && " $STEPS " != *" $name "* ]]; then
    return 0
  fi
  local STEPS=""  # step() sees no STEPS filter for this call only
  step "$@"
}

install_wheels() {  # carried wheels (if any) into a private site dir on PYTHONPATH
  mkdir -p /tmp/pagedinfer-site
  if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/pagedinfer-site .whl/*.whl
  else
    echo "no .whl/ folder: using only what the machine has"
  fi
}

# 1. environment: carried wheels, then the project itself (editable; builds the C++ extension)
step wheels install_wheels
export PYTHONPATH="/tmp/pagedinfer-site${PYTHONPATH:+:$PYTHONPATH}"
step build "$PY" -m pip install --no-build-isolation --no-deps --no-cache-dir -e .
if [[ " ${FAILED[*]} " == *" build "* ]]; then  # still let the pure-Python areas import
  mkdir -p /tmp/pagedinfer-shim/pagedinfer
  for d in engine kernels operator; do ln -sfn "$PWD/$d" "/tmp/pagedinfer-shim/pagedinfer/$d"; done
  export PYTHONPATH="/tmp/pagedinfer-shim:$PYTHONPATH"
fi
step versions "$PY" -c "import torch, triton, pagedinfer.kernels; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())"

# 2. GPU correctness (tests marked gpu, full shapes, bf16/fp16)
# Most of the test steps' time is Triton compiling kernel variants one after another on one CPU
# core; with pytest-xdist (carried in .whl/) several workers compile side by side and share
# Triton's on-disk cache (kernel tests 95 -> 41 s with 4 workers, 2026-12-04).
XDIST=()
"$PY" -c "import xdist" 2>/dev/null && XDIST=(-n "${GPU_TEST_WORKERS:-8}")
# The fused elementwise kernels first: if they fail on this Triton, the engine runs the reference
# (pre-fusion) ops for the rest of the run, and the summary says so.
step test_fused_gpu "$PY" -m pytest -q -p no:cacheprovider "${XDIST[@]}" -m gpu tests/kernels/test_fused_gpu.py
if [[ " ${FAILED[*]} " == *" test_fused_gpu "* ]]; then
  export PAGEDINFER_FUSED_KERNELS=0
  echo "- fused kernels failed: PAGEDINFER_FUSED_KERNELS=0 for the rest of the run" >>"$SUMMARY"
fi
step test_kernels_gpu "$PY" -m pytest -q -p no:cacheprovider "${XDIST[@]}" -m gpu tests/kernels --ignore=tests/kernels/test_fused_gpu.py

# 3. benchmarks (each writes JSON + PNG + a text summary into OUTDIR)
# shellcheck disable=SC2086  # ATTENTION_BENCH_ARGS (e.g. "--tune decode") splits into words
step bench_attention "$PY" bench/attention.py --out "$OUTDIR" ${ATTENTION_BENCH_ARGS:-}
# speculative verification's attention: the short-chunk kernel vs the tiled extend kernel vs decode
step bench_verify_attention "$PY" bench/verify_attention.py --out "$OUTDIR"
# the short kernel per split count and tile at the speculative benchmark's shapes (~1 min)
probe verify_attention_splits "$PY" bench/verify_attention.py --out "$OUTDIR" --split-sweep
step test_engine_gpu "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_engine_gpu.py tests/engine/models
# small-batch linear layers: torch's GEMM vs kernels/gemv.py per 8B layer shape and the step's chain
step bench_gemv "$PY" bench/gemv.py --out "$OUTDIR" --rows 1,4 --rep-ms 25
# greedy token ids: torch.argmax vs kernels/argmax.py over 1-56 rows of a vocabulary (< 20 s)
step bench_argmax "$PY" bench/argmax.py --out "$OUTDIR"
# the n-gram accept + propose kernel in a CUDA graph, tie ranking off / on (~20 s)
step bench_ngram_propose "$PY" bench/ngram_propose.py --device cuda --out "$OUTDIR"
# the one-row RMSNorm folded into the next GEMV vs a norm kernel + the GEMV (pairs and the 32-layer chain)
step bench_norm_gemv "$PY" bench/norm_gemv.py --out "$OUTDIR" --rep-ms 25
# the RMSNorm carried by GEMV epilogues at 2-16 rows vs a norm kernel (kernels and the layer chain)
step bench_norm_epilogue "$PY" bench/norm_epilogue.py --out "$OUTDIR" --rep-ms 25
# one 8B decoder layer, pre-fusion vs fused elementwise chain (graph replay, batch 1 and 256)
step bench_decode_layer "$PY" bench/decode_layer.py --out "$OUTDIR"
# decode with a JSON schema (xgrammar masks in the sampler) vs unconstrained, batch 1 and 64 (~1 min)
step bench_structured_output "$PY" -P bench/structured_output.py --devices cuda --out "$OUTDIR"
# tensor parallelism (issue 48): one decode step of the 8B shape and of the 70B shape with 20
# layers, tp 1 vs tp 2 over NCCL, against floors from bytes and the measured all-reduce (~2 min);
# only where at least 2 GPUs are visible
if [[ $("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0) -ge 2 ]]; then
  step bench_tensor_parallel "$PY" -P bench/tensor_parallel.py --out "$OUTDIR" --tps 1,2 --shapes 8b,70b \
    --layers-70b "${TP_LAYERS_70B:-20}" --batches 1,64
else
  echo "- bench_tensor_parallel: not run (fewer than 2 GPUs visible)" >>"$SUMMARY"
fi
# Probes (PROBES=all, ~+2.5 min): where a decode step's time goes (torch.profiler kernel time vs
# wall time per step, 8B shape; ~22 s), the batch-256 step's GEMMs under cuBLAS / cuBLASLt /
# TunableOp (~40 s), transformers' static batch at 64/256/512 (~90 s), a verification step's kernels.
probe profile_decode "$PY" bench/profile_decode.py --out "$OUTDIR" --batches 1,256
probe gemm_batch "$PY" bench/gemm_batch.py --out "$OUTDIR"
probe hf_peer_batches "$PY" bench/hf_peer_batches.py --out "$OUTDIR"
probe profile_spec "$PY" -P bench/profile_spec.py --out "$OUTDIR" --model "${SPEC_MODEL:-builtin://smollm2-135m}"
# vLLM 0.26 side by side (issue 47), where the carried vLLM is on this machine: .vw/ from
# ../shared/vllm-peer/fetch.sh (chunks carried one call each, bench/gpu_requirements.md) is
# installed into /tmp/vsite once; then vllm_peer runs right after our throughput step, and our
# throughput step also times TTFT / single stream / the batch-256 step the way the peer does.
VLLM_SITE=/tmp/vsite
vllm_install() { bash .vw/install.sh .vw; }
vllm_serve_wheels() {  # bench/vllm_serve_wheels.txt: what `vllm serve` needs beyond the offline set
  compgen -G ".vw/serve/*.whl" >/dev/null || { echo "no .vw/serve/: bench/fetch_vllm_serve_wheels.sh"; return 1; }
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/vsite-serve .vw/serve/*.whl
}
if [[ -f .vw/install.sh && ! -f $VLLM_SITE/.installed ]]; then
  step vllm_install vllm_install
fi
HAVE_VLLM=0
[[ -f $VLLM_SITE/.installed && -f .vw/vllm_peer.py ]] && HAVE_VLLM=1
# Only vLLM's own wheels on its PYTHONPATH: the project's (newer pydantic, openai) stay out.
VLLM_ENV=(env PYTHONPATH="$VLLM_SITE" VLLM_USE_FLASHINFER_SAMPLER=0 TVM_FFI_DISABLE_TORCH_C_DLPACK=1)
PEER_METHODS=()
((HAVE_VLLM)) && PEER_METHODS=(--peer-methods)
# transformers' peers: static batch 512 (its best measured) and generate_batch over 32 requests
# (far below the static batch at any size; 32 instead of 64 keeps the run under 9 minutes);
# THROUGHPUT_BENCH_ARGS="--skip-hf-peers" leaves them out (~1 min less)
# shellcheck disable=SC2086  # THROUGHPUT_BENCH_ARGS splits into words
step bench_throughput "$PY" bench/throughput.py --out "$OUTDIR" --hf-requests 32 --concurrency 1 8 128 256 \
  "${PEER_METHODS[@]}" ${THROUGHPUT_BENCH_ARGS:-}
if ((HAVE_VLLM)); then
  # vLLM's defaults (~3-4 min with its torch.compile), then configured like ours (256 sequences,
  # 8,192 tokens a step; ~2-3 min, its compile cache warm): $OUTDIR/vllm*/vllm_peer.json
  step vllm_peer "${VLLM_ENV[@]}" OUT="$OUTDIR/vllm" timeout 540 "$PY" .vw/vllm_peer.py
  step vllm_peer_match "${VLLM_ENV[@]}" OUT="$OUTDIR/vllm_match" timeout 480 "$PY" .vw/vllm_peer.py --match-ours
else
  echo "- vllm_peer: not run (no carried vLLM in $VLLM_SITE)" >>"$SUMMARY"
fi
# speculative decoding: (a) n-gram on SmolLM2 (SPEC_MODEL=<.gguf>, else the builtin; skipped with a
# message when neither loads), (b) 8B-shaped random target + first-2-layers draft; K = 2, 4, 6
# (SPEC_WORKLOADS=ngram or pair runs one of them, e.g. the pair in a call without the GGUF;
# SPEC_BENCH_ARGS="--rounds 3" reports each row's median round)
# shellcheck disable=SC2086  # SPEC_BENCH_ARGS splits into words
step bench_speculative "$PY" -P bench/speculative.py --device cuda --out "$OUTDIR" --workloads "${SPEC_WORKLOADS:-ngram,pair}" \
  --model "${SPEC_MODEL:-builtin://smollm2-135m}" --batches 1,8 --ks 2,4,6 --max-tokens 128 ${SPEC_BENCH_ARGS:-}
# the n-gram rows again with every speculative step synchronous (no device chain), for comparison
probe spec_ngram_sync "$PY" -P bench/speculative.py --device cuda --out "$OUTDIR/spec_sync" --workloads ngram \
  --model "${SPEC_MODEL:-builtin://smollm2-135m}" --batches 1,8 --ks 2,4,6 --max-tokens 128 --refill 0 \
  --device-chain off
# and with one chained verification step per host pass (the default launches 4 back to back)
probe spec_ngram_chain1 "$PY" -P bench/speculative.py --device cuda --out "$OUTDIR/spec_chain1" --workloads ngram \
  --model "${SPEC_MODEL:-builtin://smollm2-135m}" --batches 1,8 --ks 2,4,6 --max-tokens 128 --refill 0 \
  --device-chain-steps 1
# n-gram with seeded sampling (temperature 0.7; the same tokens as plain decoding): chained on the
# device (each row drawn there, drafts matched against the draws), then every step synchronous
probe spec_ngram_sampled "$PY" -P bench/speculative.py --device cuda --out "$OUTDIR/spec_sampled" --workloads ngram \
  --model "${SPEC_MODEL:-builtin://smollm2-135m}" --batches 1,8 --ks 2,4,6 --max-tokens 128 --temperature 0.7
probe spec_ngram_sampled_sync "$PY" -P bench/speculative.py --device cuda --out "$OUTDIR/spec_sampled_sync" \
  --workloads ngram --model "${SPEC_MODEL:-builtin://smollm2-135m}" --batches 1,8 --ks 2,4,6 --max-tokens 128 \
  --temperature 0.7 --refill 0 --device-chain off
# the pair with seeded sampling (temperature 0.7): chained (drafts drawn on the device, rejection
# sampling there), then every step synchronous
probe spec_pair_sampled "$PY" -P bench/speculative.py --device cuda --out "$OUTDIR/spec_pair_sampled" \
  --workloads pair --batches 1,8 --ks 2,4,6 --max-tokens 128 --refill 0 --temperature 0.7
probe spec_pair_sampled_sync "$PY" -P bench/speculative.py --device cuda --out "$OUTDIR/spec_pair_sampled_sync" \
  --workloads pair --batches 1,8 --ks 2,4,6 --max-tokens 128 --refill 0 --temperature 0.7 --device-chain off
# the pair again with every speculative step synchronous (draft steps not chained on the device)
probe spec_pair_sync "$PY" -P bench/speculative.py --device cuda --out "$OUTDIR/spec_pair_sync" \
  --workloads pair --batches 1,8 --ks 2,4,6 --max-tokens 128 --refill 0 --device-chain off
# the pair again with the host reading every draft step's tokens (drafts not left on the device)
probe spec_pair_host_drafts "$PY" -P bench/speculative.py --device cuda --out "$OUTDIR/spec_host_drafts" \
  --workloads pair --batches 1,8 --ks 2,4,6 --max-tokens 128 --refill 0 --device-drafts off --device-chain off
# the pair again with torch's argmax and torch's GEMM at 17-64 rows (the kernels of 2026-12-05 off: A/B)
probe spec_pair_kernels_off env PAGEDINFER_ARGMAX_KERNEL=0 PAGEDINFER_GEMV_MAX_ROWS=16 "$PY" -P bench/speculative.py \
  --device cuda --out "$OUTDIR/spec_kernels_off" --workloads pair --batches 1,8 --ks 2,4,6 --max-tokens 128 --rounds 3
# where a batch-8 K 4 pair step's device time goes (busy / idle per step, kernels by category)
probe profile_spec_b8 "$PY" -P bench/profile_spec.py --out "$OUTDIR" --workloads pair --batch 8 --k 4 --tag _b8k4
# where the host thread waits for the GPU outside collect(): torch's sync debug mode over greedy and
# seeded-sampled requests, plain and n-gram (SmolLM2; ~30 s)
# SmolLM2's linear layers at 1 row (decode) and 3 / 5 / 7 rows (n-gram verification at K 2 / 4 / 6):
# the configs the engine routes them to against the sweep's best and torch (~1 min)
probe gemv_smollm2 "$PY" bench/gemv.py --out "$OUTDIR/gemv_smollm2" --model smollm2 --rows 1,3,5,7 --rep-ms 25
# the same at 8 / 16 rows (a plain batch-8 step) and 40 / 56 (a batch-8 verification at K 4 / 6):
# one tile of all rows against 16-row blocks (GemvConfig.block_m; ~1 min)
probe gemv_smollm2_b8 "$PY" bench/gemv.py --out "$OUTDIR/gemv_smollm2_b8" --model smollm2 --rows 8,16,40,56 --rep-ms 25
# the n-gram rows again with a small model's 17-64-row GEMVs in one tile (the row blocks off: A/B)
# shellcheck disable=SC2086  # SPEC_BENCH_ARGS splits into words
probe spec_ngram_row_blocks_off env PAGEDINFER_GEMV_ROW_BLOCKS=0 "$PY" -P bench/speculative.py --device cuda \
  --out "$OUTDIR/spec_row_blocks_off" --workloads ngram --model "${SPEC_MODEL:-builtin://smollm2-135m}" \
  --batches 1,8 --ks 2,4,6 --max-tokens 128 ${SPEC_BENCH_ARGS:-}
# the n-gram rows again with each sequence's verification tokens in one attention program (token
# blocks off: A/B of the default's blocks of <= 16 padded rows; for SmolLM2 K 4 and K 6 differ:
# one packed 16-row program at K 4, one 32-row program at K 6)
# shellcheck disable=SC2086  # SPEC_BENCH_ARGS splits into words
probe spec_ngram_token_blocks_off env PAGEDINFER_SHORT_EXTEND_BLOCK_ROWS=0 "$PY" -P bench/speculative.py --device cuda \
  --out "$OUTDIR/spec_token_blocks_off" --workloads ngram --model "${SPEC_MODEL:-builtin://smollm2-135m}" \
  --batches 1,8 --ks 2,4,6 --max-tokens 128 ${SPEC_BENCH_ARGS:-}
probe sync_points "$PY" -P bench/sync_points.py --model "${SPEC_MODEL:-builtin://smollm2-135m}" --out "$OUTDIR"
# where a batch-1 K 4 n-gram step's device time goes (SmolLM2: launch-bound kernels)
probe profile_spec_ngram_b1 "$PY" -P bench/profile_spec.py --out "$OUTDIR" --workloads ngram --batch 1 --k 4 \
  --model "${SPEC_MODEL:-builtin://smollm2-135m}" --tag _ngram_b1k4
# the same at batch 8 (8 x 5-row verification groups)
probe profile_spec_ngram_b8 "$PY" -P bench/profile_spec.py --out "$OUTDIR" --workloads ngram --batch 8 --k 4 \
  --model "${SPEC_MODEL:-builtin://smollm2-135m}" --tag _ngram_b8k4
# serving overhead: gRPC + OpenAI SSE clients (own processes) vs the in-process engine (random
# Llama-3-8B shape, 128k vocab, no network); the server as shipped (engine core in its own
# process on a GPU); two engines at 0.28 of the GPU each; ~1 min (capped at 5). More variants,
# one more engine each (~+30 s): SERVING_BENCH_ARGS="--variant inproc=--no-engine-process" (the
# engine in the server's process), several API-server processes in front of one core:
# "--variant as2=--api-server-count=2 --variant as4=--api-server-count=4" (one engine each
# too); the steady state of N users:
# SERVING_BENCH_ARGS="--requests-per-client 4 --concurrency 16,64"
# shellcheck disable=SC2086  # SERVING_BENCH_ARGS splits into words
step bench_serving timeout 300 "$PY" bench/serving.py --device cuda --random-model "${SERVING_RANDOM_MODEL:-llama-8b}" \
  --concurrency 1,16,64 --max-tokens 128 --prompt-len 128 --requests-per-client 1 --rounds 3 \
  --out "$OUTDIR" ${SERVING_BENCH_ARGS:-}
# the same against `vllm serve` (issue 47): both servers in turn on the whole GPU, one client
# (bench/serving_clients.py, HTTP/SSE), N = 1, 16, 64, 256, 512 -> 128 tokens (~6 min)
if ((HAVE_VLLM)); then
  step vllm_serve_wheels vllm_serve_wheels
  # shellcheck disable=SC2086  # SERVING_VLLM_ARGS splits into words
  step serving_vllm timeout 570 "$PY" bench/serving_vllm.py --out "$OUTDIR" ${SERVING_VLLM_ARGS:-}
fi
# one table, ours / vLLM / ratio, from whatever of the above exists in OUTDIR (also from an earlier
# call on the same machine with the same OUTDIR): vllm_compare_summary.txt goes into SUMMARY.md
if compgen -G "$OUTDIR/vllm*/vllm_peer.json" >/dev/null; then
  step vllm_compare "$PY" bench/vllm_compare.py --dir "$OUTDIR"
fi

# 4. summary
for f in "$OUTDIR"/*_summary.txt; do
  [[ -f $f ]] && { echo; echo "## $(basename "$f" _summary.txt)"; echo '```'; cat "$f"; echo '```'; } >>"$SUMMARY"
done
cat "$SUMMARY"
if ((${#FAILED[@]})); then
  echo "FAILED steps: ${FAILED[*]}"
  exit 1
fi
