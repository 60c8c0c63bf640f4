#!/usr/bin/env bash
# Shared steps of the local-cluster scripts (kind-cpu.sh, kind-gpu.sh, minikube-gpu.sh):
# build images, install the Prometheus Operator CRDs (or kube-prometheus-stack), install the
# operator chart, create an InferenceEngine, wait for Ready, send one gRPC and one OpenAI
# request through a port-forward. Sourced, not run.
#
# Environment (all optional):
#   TAG              image tag to build and deploy                 (dev)
#   REGISTRY         image registry prefix                         (ghcr.io/pagedinfer)
#   BUILD_IMAGES     0: use the images as they are in REGISTRY     (1)
#   MONITORING       crds | stack | none: Prometheus Operator CRDs only, the whole
#                    kube-prometheus-stack (Prometheus + Grafana with the dashboard), or none (crds)
#   NAMESPACE        namespace of the InferenceEngine              (default)
#   READY_TIMEOUT    kubectl wait timeout                          (15m)
#   PYTHON           python with grpcio (the repo's .venv)         (.venv/bin/python)

set -euo pipefail

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
TAG=${TAG:-dev}
REGISTRY=${REGISTRY:-ghcr.io/pagedinfer}
BUILD_IMAGES=${BUILD_IMAGES:-1}
MONITORING=${MONITORING:-crds}
NAMESPACE=${NAMESPACE:-default}
READY_TIMEOUT=${READY_TIMEOUT:-15m}
OPERATOR_NAMESPACE=${OPERATOR_NAMESPACE:-pagedinfer-system}
PYTHON=${PYTHON:-$REPO_ROOT/.venv/bin/python}
LOCAL_HTTP_PORT=${LOCAL_HTTP_PORT:-18000}
LOCAL_GRPC_PORT=${LOCAL_GRPC_PORT:-15051}
PORT_FORWARD_PID=""
export PATH="$PATH:$REPO_ROOT/.tools/bin"  # the repo's helm/kubectl when none is installed

log() { printf '\n== %s\n' "$*" >&2; }
die() { printf 'error: %s\n' "$*" >&2; exit 1; }

need() {
  local tool
  for tool in "$@"; do
    command -v "$tool" >/dev/null 2>&1 || die "$tool is not installed"
  done
}

image_ref() { printf '%s/%s:%s' "$REGISTRY" "$1" "$TAG"; }

# build_image NAME DOCKERFILE: docker build from the repository root.
build_image() {
  local name=$1 dockerfile=$2
  log "building $(image_ref "$name")"
  docker build -f "$REPO_ROOT/docker/$dockerfile" -t "$(image_ref "$name")" "$REPO_ROOT"
}

# wait_gpu_node: until some node advertises nvidia.com/gpu (the device plugin is up).
wait_gpu_node() {
  local i gpus
  log "waiting for a node to advertise nvidia.com/gpu"
  for ((i = 0; i < 120; i++)); do
    gpus=$(kubectl get nodes -o jsonpath='{.items[*].status.allocatable.nvidia\.com/gpu}')
    if [[ -n ${gpus// /} ]]; then
      return 0
    fi
    sleep 5
  done
  die "no node advertises nvidia.com/gpu (is nvidia-container-toolkit configured?)"
}

# install_monitoring: the Prometheus Operator CRDs (so ServiceMonitor/PrometheusRule apply),
# or the full kube-prometheus-stack whose Grafana sidecar loads the dashboard ConfigMap.
install_monitoring() {
  case "$MONITORING" in
    none) return 0 ;;
    crds | stack) ;;
    *) die "MONITORING must be crds, stack or none (got $MONITORING)" ;;
  esac
  helm repo add prometheus-community https://prometheus-community.github.io/helm-charts --force-update >/dev/null
  if [[ $MONITORING == crds ]]; then
    log "installing the Prometheus Operator CRDs"
    helm upgrade --install prometheus-operator-crds prometheus-community/prometheus-operator-crds --wait
  else
    log "installing kube-prometheus-stack"
    helm upgrade --install kube-prometheus-stack prometheus-community/kube-prometheus-stack \
      --namespace monitoring --create-namespace --wait --timeout 10m \
      --set grafana.sidecar.dashboards.enabled=true \
      --set grafana.sidecar.dashboards.searchNamespace=ALL \
      --set prometheus.prometheusSpec.serviceMonitorSelectorNilUsesHelmValues=false \
      --set prometheus.prometheusSpec.podMonitorSelectorNilUsesHelmValues=false \
      --set prometheus.prometheusSpec.ruleSelectorNilUsesHelmValues=false
  fi
}

# install_operator [extra helm args...]: the operator chart, monitoring objects when the CRDs exist.
install_operator() {
  local monitoring=false
  [[ $MONITORING != none ]] && monitoring=true
  log "installing charts/pagedinfer-operator into $OPERATOR_NAMESPACE"
  helm upgrade --install pagedinfer-operator "$REPO_ROOT/charts/pagedinfer-operator" \
    --namespace "$OPERATOR_NAMESPACE" --create-namespace --wait --timeout 5m \
    --set image.repository="$REGISTRY/operator" --set image.tag="$TAG" \
    --set engineImages.cpu="$(image_ref engine-cpu)" --set engineImages.gpu="$(image_ref engine)" \
    --set serviceMonitor.enabled=$monitoring --set engineMonitor.enabled=$monitoring \
    --set prometheusRule.enabled=$monitoring --set dashboard.enabled=$monitoring \
    "$@"
}

# apply_sample FILE: kubectl apply an InferenceEngine; prints its resource name (kind/name).
apply_sample() {
  local file=$1
  [[ -f $file ]] || die "no sample at $file"
  log "applying $file"
  local applied
  applied=$(kubectl apply --namespace "$NAMESPACE" -f "$file" -o name)
  grep -i -m 1 '^inferenceengine' <<<"$applied" || die "$file holds no InferenceEngine"
}

# install_engine_chart NAME [helm args...]: one InferenceEngine through charts/pagedinfer-engine
# (its defaults are the CPU sample); prints its resource name (kind/name).
install_engine_chart() {
  local name=$1
  shift
  log "installing charts/pagedinfer-engine as $name"
  helm upgrade --install "$name" "$REPO_ROOT/charts/pagedinfer-engine" --namespace "$NAMESPACE" "$@" >&2
  printf 'inferenceengine.serving.pagedinfer.io/%s\n' "$name"
}

# deploy_gpu_engine [helm args...]: the shared second half of the GPU setups: monitoring, the
# operator chart, then $SAMPLE (or the embedded SmolLM2 on one GPU), wait for Ready, smoke test.
deploy_gpu_engine() {
  install_monitoring
  install_operator "$@"
  local engine
  if [[ -n $SAMPLE ]]; then
    engine=$(apply_sample "$SAMPLE")
  else
    # The embedded SmolLM2 on one GPU: no model download, runs on any NVIDIA GPU.
    engine=$(install_engine_chart smollm2-gpu --set resources.gpus=1 --set resources.memory=8Gi \
      --set engine.dtype=bfloat16)
  fi
  wait_ready "$engine"
  smoke "$engine"
  log "done: $engine is serving on a GPU (kubectl get ie -n $NAMESPACE)"
}

# wait_ready RESOURCE: until status.phase is Ready (the operator sets it once every replica is).
wait_ready() {
  local resource=$1
  log "waiting up to $READY_TIMEOUT for $resource to be Ready"
  if ! kubectl wait --namespace "$NAMESPACE" --for=jsonpath='{.status.phase}'=Ready \
    "$resource" --timeout="$READY_TIMEOUT"; then
    kubectl describe --namespace "$NAMESPACE" "$resource" >&2 || true
    kubectl get pods --namespace "$NAMESPACE" -o wide >&2 || true
    die "$resource did not become Ready"
  fi
}

stop_port_forward() {
  if [[ -n $PORT_FORWARD_PID ]]; then
    kill "$PORT_FORWARD_PID" 2>/dev/null || true
    wait "$PORT_FORWARD_PID" 2>/dev/null || true
    PORT_FORWARD_PID=""
  fi
}

# smoke RESOURCE: port-forward the engine's Service, then one gRPC Generate and one OpenAI
# chat completion (docker/cluster/smoke.py retries until the forward is up).
smoke() {
  local resource=$1 name model http_port grpc_port
  name=${resource##*/}
  model=$(kubectl get --namespace "$NAMESPACE" "$resource" -o jsonpath='{.status.servedModelName}')
  http_port=$(kubectl get --namespace "$NAMESPACE" "$resource" -o jsonpath='{.spec.service.httpPort}')
  grpc_port=$(kubectl get --namespace "$NAMESPACE" "$resource" -o jsonpath='{.spec.service.grpcPort}')
  log "port-forwarding svc/$name (model ${model:-?})"
  kubectl port-forward --namespace "$NAMESPACE" "svc/$name" \
    "$LOCAL_HTTP_PORT:${http_port:-8000}" "$LOCAL_GRPC_PORT:${grpc_port:-50051}" >/dev/null &
  PORT_FORWARD_PID=$!
  trap stop_port_forward EXIT
  "$PYTHON" "$REPO_ROOT/docker/cluster/smoke.py" \
    --http "http://127.0.0.1:$LOCAL_HTTP_PORT" --grpc "127.0.0.1:$LOCAL_GRPC_PORT" --model "$model"
  stop_port_forward
}
