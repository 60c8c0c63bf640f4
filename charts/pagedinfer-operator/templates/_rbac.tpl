{{/*
RBAC rules, least privilege: the same rules as manifests/rbac/ (tests/charts compares them),
where tests/operator checks every verb against what the operator calls. The cluster-wide and
the per-namespace modes grant exactly the same namespaced verbs.
*/}}

{{/* Cluster-scoped reads Kopf needs in every mode: CRD discovery and namespace listing. */}}
{{- define "pagedinfer-operator.clusterRules" -}}
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["get", "list", "watch"]
- apiGroups: [""]
  resources: ["namespaces"]
  verbs: ["list", "watch"]
{{- end }}

{{/* What the operator does inside a watched namespace. */}}
{{- define "pagedinfer-operator.namespacedRules" -}}
# The custom resource: Kopf's bookkeeping annotations and finalizer, then status.
- apiGroups: ["serving.pagedinfer.io"]
  resources: ["inferenceengines"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["serving.pagedinfer.io"]
  resources: ["inferenceengines/status"]
  verbs: ["get", "patch"]
# Owned objects.
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["services", "persistentvolumeclaims"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["autoscaling"]
  resources: ["horizontalpodautoscalers"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["monitoring.coreos.com"]
  resources: ["servicemonitors"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["inference.networking.k8s.io"]
  resources: ["inferencepools"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# Live stats: list the engine pods to scrape their /metrics.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list"]
# Events on the InferenceEngines.
- apiGroups: ["", "events.k8s.io"]
  resources: ["events"]
  verbs: ["create"]
{{- end }}

{{/* Kopf peering between HA replicas (only with replicaCount > 1). */}}
{{- define "pagedinfer-operator.peeringRules" -}}
- apiGroups: ["kopf.dev"]
  resources: [{{ if .Values.operator.allNamespaces }}"clusterkopfpeerings", {{ end }}"kopfpeerings"]
  verbs: ["get", "list", "watch", "patch"]
{{- end }}
