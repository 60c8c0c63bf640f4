#!/usr/bin/env bash
# Builds the engine-cpu and operator images with podman on a machine without a registry.
#   docker/build_local_images.sh [engine-cpu] [operator]     (no argument: both)
# stdout, one line per image, ready for `eval`:
#   ENGINE_IMAGE=localhost/pagedinfer/engine-cpu:<hash>
#   OPERATOR_IMAGE=localhost/pagedinfer/operator:<hash>
# Progress and podman's output go to stderr.
#
# - The base is a Debian bookworm minbase made once with debootstrap and kept as the podman
#   image $BASE_IMAGE (default localhost/debian:bookworm-local).
# - docker/wheels/ gets torch's CPU wheel with `pip download` (the engine Dockerfile says why).
# - Each image is tagged with a hash of what goes into it: the base image's id, the
#   Dockerfile, its .dockerignore and every file under its COPY sources (tracked or not
#   ignored by git, as they are in the working tree). An image with that tag already there
#   is not rebuilt, so runs of the same checkout build nothing; REBUILD=1 builds anyway
#   (from podman's layer cache; NO_CACHE=1 also bypasses that).
# Needs: podman, debootstrap (first run only), git. Environment: PODMAN, BASE_IMAGE,
# DEBIAN_MIRROR, IMAGE_PREFIX (default localhost/pagedinfer), TORCH_INDEX_URL (an extra
# index for the wheel download), CA_BUNDLE (default /etc/ssl/certs/ca-certificates.crt),
# PODMAN_RUNTIME (default runc when installed, else podman's
# default), CONTAINERS_CONF (default ../shared/k8s/etc/podman/ when there).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PODMAN=${PODMAN:-podman}
BASE_IMAGE=${BASE_IMAGE:-localhost/debian:bookworm-local}
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
IMAGE_PREFIX=${IMAGE_PREFIX:-localhost/pagedinfer}
SHARED_CONF="$ROOT/../shared/k8s/etc/podman/containers.conf"
if [[ -z ${CONTAINERS_CONF:-} && -f $SHARED_CONF ]]; then
  export CONTAINERS_CONF=$SHARED_CONF # cgroup_manager=cgroupfs, default_ulimits=[]
fi

# runc: the runtime these machines' podman set-up was proven with (../shared/k8s/README.md).
RUNTIME=${PODMAN_RUNTIME:-$(command -v runc >/dev/null && echo runc || true)}

# pip in the build trusts the host's CA bundle (a TLS-intercepting proxy signs PyPI here).
CA_BUNDLE=${CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
CA_ARGS=()
if [[ -f $CA_BUNDLE ]]; then
  CA_ARGS=(--volume "$CA_BUNDLE:/etc/ssl/build-ca.crt:ro" --build-arg REQUESTS_CA_BUNDLE=/etc/ssl/build-ca.crt)
fi

log() { echo "build_local_images: $*" >&2; }
pod() { "$PODMAN" ${RUNTIME:+--runtime "$RUNTIME"} "$@"; }

# 0: the image is there, 1: it is not; podman failing otherwise stops the script.
image_exists() {
  local rc=0
  pod image exists "$1" || rc=$?
  [[ $rc -le 1 ]] || {
    log "podman failed ($rc) looking for $1"
    exit 1
  }
  return "$rc"
}

make_base() {
  if image_exists "$BASE_IMAGE"; then
    return 0
  fi
  command -v debootstrap >/dev/null || {
    log "no $BASE_IMAGE and no debootstrap: apt-get install -y debootstrap"
    exit 1
  }
  local rootfs start=$SECONDS
  rootfs=$(mktemp -d "${TMPDIR:-/var/tmp}/debian-rootfs.XXXXXX")
  # shellcheck disable=SC2064 # expand now: the folder of this call
  trap "rm -rf '$rootfs'" EXIT
  log "making $BASE_IMAGE with debootstrap (once)"
  debootstrap --variant=minbase bookworm "$rootfs" "$DEBIAN_MIRROR" >&2
  # debootstrap keeps the .debs it installed and apt's lists: ~100 MB no image needs.
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/lib/apt/lists/*
  tar -C "$rootfs" -c . | pod import - "$BASE_IMAGE" >&2
  rm -rf "$rootfs"
  trap - EXIT
  log "$BASE_IMAGE made in $((SECONDS - start)) s"
}

fetch_torch_wheel() {
  local version python=python3
  version=$(sed -n 's/^ARG TORCH_VERSION=//p' docker/engine-cpu.Dockerfile)
  if compgen -G "docker/wheels/torch-${version}+cpu-*.whl" >/dev/null; then
    return 0
  fi
  [[ -x .venv/bin/python ]] && python=.venv/bin/python
  local extra=()
  [[ -n ${TORCH_INDEX_URL:-} ]] && extra=(--extra-index-url "$TORCH_INDEX_URL")
  log "fetching torch==${version}+cpu into docker/wheels/"
  "$python" -m pip download --quiet --no-deps --only-binary=:all: \
    --platform "manylinux_2_28_$(uname -m)" --python-version 3.11 --implementation cp --abi cp311 \
    --dest docker/wheels "${extra[@]}" "torch==${version}+cpu" >&2 ||
    log "no torch CPU wheel found: the build takes torch from the PyTorch CPU index"
}

# The COPY sources of a Dockerfile (not COPY --from=stage), one per line.
copy_sources() {
  awk '$1 == "COPY" && $2 !~ /^--from=/ { for (i = 2; i < NF; i++) if ($i !~ /^--/) print $i }' "$1"
}

content_hash() {
  local dockerfile=$1 sources
  mapfile -t sources < <(copy_sources "$dockerfile")
  {
    echo "base $(pod image inspect --format '{{.Id}}' "$BASE_IMAGE")"
    git ls-files -z --cached --others --exclude-standard -- \
      "$dockerfile" "$dockerfile.dockerignore" "${sources[@]}" |
      sort -z | while IFS= read -r -d '' path; do
      [[ -f $path ]] && printf '%s\0' "$path" # a tracked file deleted in the working tree
    done | xargs -0 sha256sum
    if [[ " ${sources[*]} " == *" docker/wheels/ "* ]]; then
      find docker/wheels -name '*.whl' -type f -print0 | sort -z | xargs -0 -r sha256sum
    fi
  } | sha256sum | cut -c1-12
}

build() {
  local name=$1 var=$2 dockerfile="docker/$1.Dockerfile" image start=$SECONDS
  image="$IMAGE_PREFIX/$name:$(content_hash "$dockerfile")"
  if [[ ${REBUILD:-0} != 1 ]] && image_exists "$image"; then
    log "$image is there: not rebuilt"
  else
    log "building $image"
    pod build --network host --layers -f "$dockerfile" --ignorefile "$dockerfile.dockerignore" \
      --build-arg "BASE_IMAGE=$BASE_IMAGE" "${CA_ARGS[@]}" ${NO_CACHE:+--no-cache} -t "$image" . >&2
    log "$image built in $((SECONDS - start)) s"
  fi
  echo "$var=$image"
}

main() {
  local targets=("$@")
  [[ ${#targets[@]} -eq 0 ]] && targets=(engine-cpu operator)
  make_base
  for target in "${targets[@]}"; do
    case $target in
      engine-cpu)
        fetch_torch_wheel
        build engine-cpu ENGINE_IMAGE
        ;;
      operator) build operator OPERATOR_IMAGE ;;
      *)
        log "unknown image $target (engine-cpu, operator)"
        exit 2
        ;;
    esac
  done
}

main "$@"
