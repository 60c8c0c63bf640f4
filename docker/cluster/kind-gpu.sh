#!/usr/bin/env bash
# A kind cluster whose node sees the host's NVIDIA GPUs, then the operator and a GPU engine
# (the engine chart with the embedded SmolLM2 on one GPU, or SAMPLE=file.yaml).
#   docker/cluster/kind-gpu.sh
# Host prerequisites: an NVIDIA driver and nvidia-container-toolkit configured for kind:
#   sudo nvidia-ctk runtime configure --runtime=docker --set-as-default
#   sudo nvidia-ctk config --set accept-nvidia-visible-devices-as-volume-mounts=true --in-place
#   sudo systemctl restart docker
# The GPU Operator then installs the container toolkit and device plugin inside the node
# (the driver stays the host's).
# shellcheck source=docker/cluster/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

CLUSTER=${CLUSTER:-pagedinfer-gpu}
SAMPLE=${SAMPLE:-}  # an InferenceEngine file; unset: the SmolLM2 engine chart on one GPU
GPU_OPERATOR_VERSION=${GPU_OPERATOR_VERSION:-v25.3.2}

need docker kind kubectl helm nvidia-smi "$PYTHON"
nvidia-smi -L >&2 || die "no NVIDIA GPU visible on this host"

if ! kind get clusters | grep -qx "$CLUSTER"; then
  log "creating kind cluster $CLUSTER with the host GPUs mounted"
  kind create cluster --name "$CLUSTER" --wait 120s --config - <<'KIND'
kind: Cluster
apiVersion: kind.x-k8s.io/v1alpha4
nodes:
  - role: control-plane
    extraMounts:
      # nvidia-container-toolkit's volume-mount mode: expose every GPU to the node container.
      - hostPath: /dev/null
        containerPath: /var/run/nvidia-container-devices/all
KIND
fi
kubectl config use-context "kind-$CLUSTER" >/dev/null

log "installing the NVIDIA GPU Operator (host driver, in-node toolkit and device plugin)"
helm repo add nvidia https://helm.ngc.nvidia.com/nvidia --force-update >/dev/null
helm upgrade --install gpu-operator nvidia/gpu-operator --version "$GPU_OPERATOR_VERSION" \
  --namespace gpu-operator --create-namespace --wait --timeout 10m \
  --set driver.enabled=false
wait_gpu_node

if [[ $BUILD_IMAGES == 1 ]]; then
  build_image engine engine-cuda.Dockerfile
  build_image operator operator.Dockerfile
  kind load docker-image --name "$CLUSTER" "$(image_ref engine)" "$(image_ref operator)"
fi

deploy_gpu_engine "$@"  # extra arguments go to helm (e.g. --set operator.allNamespaces=false)
