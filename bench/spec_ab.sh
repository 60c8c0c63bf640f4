#!/usr/bin/env bash
# Interleaved A/B of bench/speculative.py under environment settings, on one machine:
#
#   bench/spec_ab.sh OUTDIR MODEL.gguf [REPEATS] ARM...
#   ARM = TAG or TAG:VAR=VALUE[,VAR=VALUE...]   (e.g. A  B:PAGEDINFER_SHORT_EXTEND_BLOCK_ROWS=8)
#
# Runs the arms in turn, REPEATS times (default 2: A B A B), each as its own process (module-level
# switches are read at import), n-gram workload; SPEC_AB_ARGS replaces the default
# "--batches 1,8 --ks 2,4,6 --max-tokens 128 --rounds 3". Each run goes to OUTDIR/TAGn; the
# script prints batch, K, the request ratio, the full-batch ratio and vstep of each, one line a run.
# The A/B tables of bench/NOTES.md sessions 32 and 33 were run this way.
set -uo pipefail
OUTDIR=$(realpath -m "${1:?usage: bench/spec_ab.sh OUTDIR MODEL [REPEATS] ARM...}")
MODEL=${2:?model (.gguf or builtin://smollm2-135m)}
shift 2
REPEATS=2
if [[ ${1:-} =~ ^[0-9]+$ ]]; then
  REPEATS=$1
  shift
fi
(($# > 0)) || { echo "no arms given" >&2; exit 2; }
cd "$(dirname "$0")/.." || exit 1
PY=${PYTHON:-python3}
read -r -a ARGS <<<"${SPEC_AB_ARGS:---batches 1,8 --ks 2,4,6 --max-tokens 128 --rounds 3}"
mkdir -p "$OUTDIR"
status=0
for ((i = 1; i <= REPEATS; i++)); do
  for arm in "$@"; do
    tag=${arm%%:*}
    settings=()
    [[ $arm == *:* ]] && IFS=, read -r -a settings <<<"${arm#*:}"
    out="$OUTDIR/$tag$i"
    env "${settings[@]}" "$PY" -P bench/speculative.py --device cuda --out "$out" --workloads ngram \
      --model "$MODEL" "${ARGS[@]}" >"$out.log" 2>&1
    rc=$?
    ((rc == 0)) || status=1
    # columns of speculative_report's first table: B K ... req. ratio (13), full-batch ratio (16), vstep (17)
    printf '%-6s rc=%s %s | ' "$tag$i" "$rc" "${settings[*]:-default}"
    awk '/^ngram/ && NF > 15 {printf "B%s K%s req %s full %s vstep %s; ", $2, $3, $13, $16, $17}' \
      "$out"/*summary.txt 2>/dev/null
    echo
  done
done
exit $status
