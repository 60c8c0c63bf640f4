"""The API resources the operator reads and writes, and their URL paths."""

from __future__ import annotations

from dataclasses import dataclass

from pagedinfer.operator.spec import GROUP, KIND, PLURAL, VERSION


@dataclass(frozen=True)
class Resource:
    group: str  # "" for the core API
    version: str
    plural: str
    kind: str

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    def path(self, namespace: str, name: str | None = None, subresource: str | None = None) -> str:
        root = f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"
        url = f"{root}/namespaces/{namespace}/{self.plural}"
        if name is not None:
            url += f"/{name}"
        if subresource is not None:
            url += f"/{subresource}"
        return url


INFERENCE_ENGINE = Resource(GROUP, VERSION, PLURAL, KIND)
DEPLOYMENT = Resource("apps", "v1", "deployments", "Deployment")
SERVICE = Resource("", "v1", "services", "Service")
PVC = Resource("", "v1", "persistentvolumeclaims", "PersistentVolumeClaim")
POD = Resource("", "v1", "pods", "Pod")
PDB = Resource("policy", "v1", "poddisruptionbudgets", "PodDisruptionBudget")
HPA = Resource("autoscaling", "v2", "horizontalpodautoscalers", "HorizontalPodAutoscaler")
SERVICE_MONITOR = Resource("monitoring.coreos.com", "v1", "servicemonitors", "ServiceMonitor")
CRD = Resource("apiextensions.k8s.io", "v1", "customresourcedefinitions", "CustomResourceDefinition")
INFERENCE_POOL = Resource("inference.networking.k8s.io", "v1", "inferencepools", "InferencePool")
SERVICE_MONITOR_CRD_NAME = "servicemonitors.monitoring.coreos.com"
INFERENCE_POOL_CRD_NAME = "inferencepools.inference.networking.k8s.io"

# Every kind the operator owns, in the order it applies them (storage before the pods use it).
OWNED: tuple[Resource, ...] = (PVC, SERVICE, DEPLOYMENT, PDB, HPA, SERVICE_MONITOR, INFERENCE_POOL)
# Owned kinds whose CRD a cluster may lack: name of that CRD.
OPTIONAL_CRDS: dict[Resource, str] = {
    SERVICE_MONITOR: SERVICE_MONITOR_CRD_NAME,
    INFERENCE_POOL: INFERENCE_POOL_CRD_NAME,
}
BY_KIND: dict[str, Resource] = {r.kind: r for r in OWNED}
