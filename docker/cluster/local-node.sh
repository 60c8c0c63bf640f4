#!/usr/bin/env bash
# The operator plus the CPU SmolLM2-135M sample on the real local node of ../shared/k8s: no
# Docker engine and no registry (images built with podman, imported into the node's containerd).
#   docker/cluster/local-node.sh              start the control plane and node, build, deploy, smoke-test
#   SAMPLE=my-ie.yaml NAMESPACE=demo docker/cluster/local-node.sh [extra helm args]
# Needs root, podman + debootstrap and the node's apt packages (scripts/setup.sh --dev installs
# them), kubectl and helm (.tools/bin). Leaves everything running; stop with ../shared/k8s/down.sh.
# shellcheck source=docker/cluster/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

K8S=${K8S:-$REPO_ROOT/../shared/k8s}
SAMPLE=${SAMPLE:-$REPO_ROOT/manifests/samples/smollm2-cpu.yaml}
API_PORT=${K8S_REAL_API_PORT:-16443}
# shellcheck disable=SC2034 # read by install_operator in lib.sh
MONITORING=none # the node has no Prometheus Operator (only its CRDs)
# The operator's metrics port on the node's network (hostNetwork below).
OPERATOR_METRICS_PORT=${OPERATOR_METRICS_PORT:-18080}

need kubectl helm podman "$PYTHON"
[[ -x $K8S/up.sh ]] || die "no control plane scripts in $K8S"
cd "$REPO_ROOT" || exit 1 # ../shared/k8s keeps its state in ./.k8s of the working directory

log "starting the control plane and the node ($K8S)"
KUBECTL=$(command -v kubectl) "$K8S/up.sh" >&2
export KUBECONFIG=$REPO_ROOT/.k8s/kubeconfig
# (node-up.sh is idempotent, but its image check can trip over a long image list: skip a Ready node)
if ! kubectl wait --for=condition=Ready node --all --timeout=1s >/dev/null 2>&1; then
  "$K8S/node-up.sh" >&2
fi

log "building the images (cached by content hash)"
eval "$("$REPO_ROOT/docker/build_local_images.sh")"
node_images=$("$K8S/images.sh" ls) # (a variable: grep -q closing a pipe early fails under pipefail)
for image in "$ENGINE_IMAGE" "$OPERATOR_IMAGE"; do
  if ! grep -qxF "$image" <<<"$node_images"; then
    "$K8S/images.sh" import "$image" >&2
  fi
done

# The API server listens on the node's loopback only: the operator pod joins the node's network
# and is told where the API is (a values override for this node, not the chart's default).
install_operator \
  --set image.repository="${OPERATOR_IMAGE%:*}" --set image.tag="${OPERATOR_IMAGE##*:}" \
  --set image.pullPolicy=Never --set engineImages.cpu="$ENGINE_IMAGE" \
  --set hostNetwork=true --set metrics.port="$OPERATOR_METRICS_PORT" \
  --set-json "operator.extraEnv=[{\"name\":\"KUBERNETES_SERVICE_HOST\",\"value\":\"127.0.0.1\"},{\"name\":\"KUBERNETES_SERVICE_PORT\",\"value\":\"$API_PORT\"}]" \
  "$@" >&2
kubectl get namespace "$NAMESPACE" >/dev/null 2>&1 || kubectl create namespace "$NAMESPACE" >&2
engine=$(apply_sample "$SAMPLE")
wait_ready "$engine"
smoke "$engine"
log "done: $engine is serving (kubectl get ie -n $NAMESPACE; KUBECONFIG=$KUBECONFIG)"
