#!/usr/bin/env bash
# A minikube cluster with every host GPU (`--gpus all`, docker driver), then the operator and
# a GPU engine (the engine chart with the embedded SmolLM2 on one GPU, or SAMPLE=file.yaml).
# minikube enables its nvidia-device-plugin addon itself with --gpus.
#   docker/cluster/minikube-gpu.sh
# Host prerequisites: an NVIDIA driver and nvidia-container-toolkit configured for docker.
# shellcheck source=docker/cluster/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

PROFILE=${PROFILE:-pagedinfer}
SAMPLE=${SAMPLE:-}  # an InferenceEngine file; unset: the SmolLM2 engine chart on one GPU
MINIKUBE_CPUS=${MINIKUBE_CPUS:-8}
MINIKUBE_MEMORY=${MINIKUBE_MEMORY:-32g}

need docker minikube kubectl helm nvidia-smi "$PYTHON"
nvidia-smi -L >&2 || die "no NVIDIA GPU visible on this host"

if ! minikube status --profile "$PROFILE" >/dev/null 2>&1; then
  log "starting minikube profile $PROFILE with --gpus all"
  minikube start --profile "$PROFILE" --driver docker --container-runtime docker --gpus all \
    --cpus "$MINIKUBE_CPUS" --memory "$MINIKUBE_MEMORY"
fi
kubectl config use-context "$PROFILE" >/dev/null
wait_gpu_node

if [[ $BUILD_IMAGES == 1 ]]; then
  build_image engine engine-cuda.Dockerfile
  build_image operator operator.Dockerfile
  for image in "$(image_ref engine)" "$(image_ref operator)"; do
    minikube image load --profile "$PROFILE" "$image"
  done
fi

deploy_gpu_engine "$@"  # extra arguments go to helm (e.g. --set operator.allNamespaces=false)
