"""The engine Deployment: `pagedinfer serve` with the spec's flags, probes, drain and hardening."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from pagedinfer.operator.builders import meta
from pagedinfer.operator.builders.model_source import MODELS_DIR, MODELS_VOLUME, ModelSource, resolve
from pagedinfer.operator.config import OperatorConfig
from pagedinfer.operator.spec import InferenceEngineSpec

CONTAINER = "engine"
INIT_CONTAINER = "fetch-model"
DRAFT_INIT_CONTAINER = "fetch-draft-model"
STARTUP_PERIOD_SECONDS = 10


@dataclass(frozen=True)
class RenderInput:
    """Everything a builder reads: the CR's identity, its parsed spec, the operator's settings."""

    ref: meta.EngineRef
    spec: InferenceEngineSpec
    config: OperatorConfig

    @property
    def served_name(self) -> str:
        return self.spec.model.served_name or self.ref.name

    @property
    def is_gpu(self) -> bool:
        return self.spec.resources.gpus > 0


def build_deployment(inp: RenderInput) -> dict[str, Any]:
    spec = inp.spec
    main, draft = _sources(inp)
    template = {"metadata": {"labels": meta.common_labels(inp.ref)}, "spec": _pod_spec(inp, main, draft)}
    annotations = {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(spec.service.http_port),
        "prometheus.io/path": "/metrics",
    }
    annotations[meta.CONFIG_HASH_ANNOTATION] = meta.config_hash({"template": template, "ann": annotations})
    template["metadata"]["annotations"] = annotations
    body: dict[str, Any] = {
        "selector": {"matchLabels": meta.selector_labels(inp.ref)},
        "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
        "revisionHistoryLimit": 5,
        "progressDeadlineSeconds": spec.lifecycle.startup_timeout_seconds + 600,
        "template": template,
    }
    # With autoscaling the HPA owns the replica count: leave the field out so it is never overwritten.
    if not spec.autoscaling.enabled:
        body["replicas"] = spec.replicas
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": meta.object_meta(inp.ref, inp.ref.name),
        "spec": body,
    }


def initial_replicas(spec: InferenceEngineSpec) -> int:
    """Replicas a new Deployment starts with (with autoscaling, the HPA's floor)."""
    return spec.autoscaling.min_replicas if spec.autoscaling.enabled else spec.replicas


def _sources(inp: RenderInput) -> tuple[ModelSource, ModelSource | None]:
    model = inp.spec.model
    main = resolve(model.uri, model.revision)
    spec_cfg = inp.spec.engine.speculative
    draft = resolve(spec_cfg.draft_model) if spec_cfg and spec_cfg.draft_model else None
    return main, draft


def _pod_spec(inp: RenderInput, main: ModelSource, draft: ModelSource | None) -> dict[str, Any]:
    spec, sched = inp.spec, inp.spec.scheduling
    sources = [s for s in (main, draft) if s is not None]
    downloads = [s.download for s in sources if s.download is not None]
    pod: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": spec.lifecycle.effective_grace_seconds,
        "securityContext": _pod_security(inp.config.run_as_user),
        "containers": [_engine_container(inp, main, draft, sources, bool(downloads))],
        "volumes": _volumes(inp, sources, bool(downloads)),
        "topologySpreadConstraints": [
            {
                "maxSkew": 1,
                "topologyKey": "kubernetes.io/hostname",
                "whenUnsatisfiable": "ScheduleAnyway",
                "labelSelector": {"matchLabels": meta.selector_labels(inp.ref)},
            }
        ],
    }
    inits = [(INIT_CONTAINER, main), (DRAFT_INIT_CONTAINER, draft)]
    init_containers = [_init_container(inp, n, s.download.args()) for n, s in inits if s and s.download]
    if init_containers:
        pod["initContainers"] = init_containers
    if sched.node_selector:
        pod["nodeSelector"] = dict(sched.node_selector)
    tolerations = _tolerations(inp)
    if tolerations:
        pod["tolerations"] = tolerations
    if sched.affinity:
        pod["affinity"] = dict(sched.affinity)
    if sched.priority_class_name:
        pod["priorityClassName"] = sched.priority_class_name
    if sched.runtime_class_name:
        pod["runtimeClassName"] = sched.runtime_class_name
    return pod


def serve_args(inp: RenderInput, main: ModelSource, draft: ModelSource | None) -> list[str]:
    """`pagedinfer serve` arguments (the engine CLI contract)."""
    spec, eng = inp.spec, inp.spec.engine
    args = ["serve", "--model", main.serve_uri, "--served-model-name", inp.served_name]
    if spec.model.revision and main.download is None:
        args += ["--revision", spec.model.revision]
    args += ["--host", "0.0.0.0", "--http-port", str(spec.service.http_port)]
    args += ["--grpc-port", str(spec.service.grpc_port), "--device", "cuda" if inp.is_gpu else "cpu"]
    args += ["--dtype", eng.dtype.value, "--block-size", str(eng.block_size)]
    args += ["--max-num-seqs", str(eng.max_num_seqs)]
    if eng.max_model_len is not None:
        args += ["--max-model-len", str(eng.max_model_len)]
    args += ["--gpu-memory-utilization", _float(eng.gpu_memory_utilization)]
    args.append("--enable-prefix-caching" if eng.enable_prefix_caching else "--no-enable-prefix-caching")
    args += ["--tensor-parallel-size", str(eng.tensor_parallel_size)]
    if eng.speculative is not None:
        args += ["--speculative-method", eng.speculative.method.value]
        if draft is not None:
            args += ["--speculative-model", draft.serve_uri]
        args += ["--num-speculative-tokens", str(eng.speculative.num_tokens)]
    args += ["--drain-timeout", str(spec.lifecycle.drain_timeout_seconds)]
    return args + list(eng.extra_args)


def _engine_container(
    inp: RenderInput,
    main: ModelSource,
    draft: ModelSource | None,
    sources: list[ModelSource],
    has_models_volume: bool,
) -> dict[str, Any]:
    spec = inp.spec
    mounts = [{"name": "tmp", "mountPath": "/tmp"}]
    if has_models_volume:
        mounts.append({"name": MODELS_VOLUME, "mountPath": MODELS_DIR, "readOnly": True})
    if inp.is_gpu:
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    mounts += [m for s in sources for m in s.mounts]
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": image(inp),
        "imagePullPolicy": spec.image_pull_policy.value,
        "command": ["pagedinfer"],
        "args": serve_args(inp, main, draft),
        "ports": [
            {"name": "http", "containerPort": spec.service.http_port, "protocol": "TCP"},
            {"name": "grpc", "containerPort": spec.service.grpc_port, "protocol": "TCP"},
        ],
        "env": _engine_env(inp),
        "resources": _resources(inp),
        "volumeMounts": mounts,
        "securityContext": container_security(inp.config.run_as_user),
        **_probes(inp),
    }
    if spec.lifecycle.pre_stop_seconds > 0:
        # Endpoints stop routing to the pod while it sleeps; SIGTERM then starts the engine's drain.
        container["lifecycle"] = {"preStop": {"sleep": {"seconds": spec.lifecycle.pre_stop_seconds}}}
    return container


def image(inp: RenderInput) -> str:
    if inp.spec.image:
        return inp.spec.image
    return inp.config.image_gpu if inp.is_gpu else inp.config.image_cpu


def _engine_env(inp: RenderInput) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        {"name": "HOME", "value": "/tmp"},
        {"name": "HF_HOME", "value": "/tmp/hf"},
        {"name": "PAGEDINFER_DRAIN_TIMEOUT", "value": str(inp.spec.lifecycle.drain_timeout_seconds)},
    ]
    auth = inp.spec.auth
    if auth is not None:
        ref = auth.api_key_secret_ref
        env.append(
            {"name": "PAGEDINFER_API_KEY", "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}
        )
    return env


def _resources(inp: RenderInput) -> dict[str, Any]:
    res = inp.spec.resources
    requests: dict[str, Any] = {"cpu": str(res.cpu), "memory": str(res.memory)}
    limits: dict[str, Any] = {"memory": str(res.memory)}
    if inp.is_gpu:
        requests[res.gpu_resource_name] = str(res.gpus)
        limits[res.gpu_resource_name] = str(res.gpus)
    return {"requests": requests, "limits": limits}


def _probes(inp: RenderInput) -> dict[str, Any]:
    startup_failures = math.ceil(inp.spec.lifecycle.startup_timeout_seconds / STARTUP_PERIOD_SECONDS)
    return {
        # Generous: weights load before /startup answers; liveness only starts after it succeeds.
        "startupProbe": {
            "httpGet": {"path": "/startup", "port": "http"},
            "periodSeconds": STARTUP_PERIOD_SECONDS,
            "timeoutSeconds": 5,
            "failureThreshold": startup_failures,
        },
        "readinessProbe": {
            "grpc": {"port": inp.spec.service.grpc_port},
            "periodSeconds": 5,
            "timeoutSeconds": 3,
            "failureThreshold": 3,
        },
        "livenessProbe": {
            "httpGet": {"path": "/health", "port": "http"},
            "periodSeconds": 15,
            "timeoutSeconds": 5,
            "failureThreshold": 4,
        },
    }


def _init_container(inp: RenderInput, name: str, download_args: list[str]) -> dict[str, Any]:
    """Fetches one remote model into the cache volume; `download` skips what is already complete."""
    env: list[dict[str, Any]] = [{"name": "HOME", "value": "/tmp"}, {"name": "HF_HOME", "value": "/tmp/hf"}]
    token = inp.spec.model.token_secret_ref
    if token is not None:
        env.append(
            {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": token.name, "key": token.key}}}
        )
    return {
        "name": name,
        "image": image(inp),
        "imagePullPolicy": inp.spec.image_pull_policy.value,
        "command": ["pagedinfer"],
        "args": download_args,
        "env": env,
        "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"memory": "4Gi"}},
        "volumeMounts": [
            {"name": "tmp", "mountPath": "/tmp"},
            {"name": MODELS_VOLUME, "mountPath": MODELS_DIR},
        ],
        "securityContext": container_security(inp.config.run_as_user),
    }


def _volumes(inp: RenderInput, sources: list[ModelSource], has_models_volume: bool) -> list[dict[str, Any]]:
    volumes: list[dict[str, Any]] = [{"name": "tmp", "emptyDir": {}}]
    if has_models_volume:
        if inp.spec.model_cache is not None:
            claim = {"claimName": meta.model_cache_name(inp.ref)}
            volumes.append({"name": MODELS_VOLUME, "persistentVolumeClaim": claim})
        else:
            volumes.append({"name": MODELS_VOLUME, "emptyDir": {}})
    if inp.is_gpu:
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": shm_size(inp)}})
    seen: set[str] = set()
    for source in sources:
        for volume in source.volumes:
            if volume["name"] not in seen:
                seen.add(volume["name"])
                volumes.append(volume)
    return volumes


def shm_size(inp: RenderInput) -> str:
    """The memory-backed /dev/shm of a GPU pod: 1 GiB per tensor-parallel rank. NCCL's
    shared-memory transport between the ranks of one pod and torch's IPC buffers live there (a
    container's default 64 MiB makes NCCL fail or fall back); it counts against the memory limit."""
    return f"{inp.spec.engine.tensor_parallel_size}Gi"


def _tolerations(inp: RenderInput) -> list[dict[str, Any]]:
    tolerations = [dict(t) for t in inp.spec.scheduling.tolerations]
    gpu_key = inp.spec.resources.gpu_resource_name
    if inp.is_gpu and not any(t.get("key") == gpu_key for t in tolerations):
        tolerations.append({"key": gpu_key, "operator": "Exists", "effect": "NoSchedule"})
    return tolerations


def _pod_security(uid: int) -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": uid,
        "runAsGroup": uid,
        "fsGroup": uid,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security(uid: int) -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": uid,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "privileged": False,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _float(value: float) -> str:
    return f"{value:g}"
