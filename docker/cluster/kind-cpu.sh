#!/usr/bin/env bash
# A kind cluster with no GPU: the operator plus the CPU SmolLM2-135M sample, end to end.
#   docker/cluster/kind-cpu.sh            create (or reuse) cluster "pagedinfer", deploy, smoke-test
#   CLUSTER=dev SAMPLE=my-ie.yaml docker/cluster/kind-cpu.sh
# Needs docker, kind, kubectl and helm (scripts/install_k8s_tools.sh gives the last two).
# shellcheck source=docker/cluster/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

CLUSTER=${CLUSTER:-pagedinfer}
SAMPLE=${SAMPLE:-$REPO_ROOT/manifests/samples/smollm2-cpu.yaml}

need docker kind kubectl helm "$PYTHON"

if ! kind get clusters | grep -qx "$CLUSTER"; then
  log "creating kind cluster $CLUSTER"
  kind create cluster --name "$CLUSTER" --wait 120s
fi
kubectl config use-context "kind-$CLUSTER" >/dev/null

if [[ $BUILD_IMAGES == 1 ]]; then
  build_image engine-cpu engine-cpu.Dockerfile
  build_image operator operator.Dockerfile
  kind load docker-image --name "$CLUSTER" "$(image_ref engine-cpu)" "$(image_ref operator)"
fi

install_monitoring
install_operator "$@"  # extra arguments go to helm (e.g. --set operator.allNamespaces=false)
engine=$(apply_sample "$SAMPLE")
wait_ready "$engine"
smoke "$engine"
log "done: $engine is serving (kubectl get ie -n $NAMESPACE)"
