"""Operator configuration: the one place environment variables are read (`OperatorConfig.from_env`)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

from pagedinfer.operator.version import OPERATOR_VERSION

ENV_PREFIX = "PAGEDINFER_OPERATOR_"


@dataclass(frozen=True)
class OperatorConfig:
    """How the operator renders and reconciles; CLI flags override the environment."""

    image_gpu: str = f"ghcr.io/pagedinfer/engine:{OPERATOR_VERSION}"
    image_cpu: str = f"ghcr.io/pagedinfer/engine-cpu:{OPERATOR_VERSION}"
    resync_seconds: float = 60.0  # full reconcile of every CR (drift is also repaired on watch events)
    stats_seconds: float = 30.0  # scrape the pods' /metrics into status.stats
    scrape_timeout_seconds: float = 2.0
    enable_stats: bool = True
    cluster_domain: str = "cluster.local"
    metrics_port: int = 8080  # the operator's own /metrics and /healthz; 0 disables
    max_backoff_seconds: float = 60.0
    max_concurrent_reconciles: int = 8  # across all CRs: bounds the load on the API server
    namespaces: tuple[str, ...] = field(default_factory=tuple)  # empty: all namespaces
    run_as_user: int = 1000

    @staticmethod
    def from_env(environ: dict[str, str] | None = None) -> OperatorConfig:
        env = os.environ if environ is None else environ
        base = OperatorConfig()
        get = lambda key, default: env.get(ENV_PREFIX + key, default)  # noqa: E731
        namespaces = tuple(ns for ns in get("NAMESPACES", "").split(",") if ns.strip())
        return replace(
            base,
            image_gpu=get("IMAGE_GPU", base.image_gpu),
            image_cpu=get("IMAGE_CPU", base.image_cpu),
            resync_seconds=float(get("RESYNC_SECONDS", base.resync_seconds)),
            stats_seconds=float(get("STATS_SECONDS", base.stats_seconds)),
            enable_stats=get("ENABLE_STATS", "1") not in ("0", "false", "False"),
            cluster_domain=get("CLUSTER_DOMAIN", base.cluster_domain),
            metrics_port=int(get("METRICS_PORT", base.metrics_port)),
            max_concurrent_reconciles=int(get("MAX_CONCURRENT_RECONCILES", base.max_concurrent_reconciles)),
            namespaces=tuple(ns.strip() for ns in namespaces),
        )
