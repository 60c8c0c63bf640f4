{{/*
RBAC rules, least privilege. Kept in one place so the cluster-wide and the per-namespace
modes grant exactly the same namespaced verbs. Mirrors manifests/rbac/ (a test compares).
*/}}

{{/* Cluster-scoped reads Kopf needs in every mode: CRD discovery and namespace listing. */}}
{{- define "pagedinfer-operator.clusterRules" -}}
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["get", "list", "watch"]
- apiGroups: [""]
  resources: ["namespaces"]
  verbs: ["get", "list", "watch"]
{{- end }}

{{/* What the operator does inside a watched namespace. */}}
{{- define "pagedinfer-operator.namespacedRules" -}}
- apiGroups: ["serving.pagedinfer.io"]
  resources: ["inferenceengines"]
  verbs: ["get", "list", "watch", "patch", "update"]
- apiGroups: ["serving.pagedinfer.io"]
  resources: ["inferenceengines/status"]
  verbs: ["get", "patch", "update"]
- apiGroups: ["serving.pagedinfer.io"]
  resources: ["inferenceengines/finalizers"]
  verbs: ["update"]
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "create", "update", "patch", "delete"]
- apiGroups: [""]
  resources: ["services", "persistentvolumeclaims"]
  verbs: ["get", "list", "watch", "create", "update", "patch", "delete"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "list", "watch", "create", "update", "patch", "delete"]
- apiGroups: ["autoscaling"]
  resources: ["horizontalpodautoscalers"]
  verbs: ["get", "list", "watch", "create", "update", "patch", "delete"]
- apiGroups: ["monitoring.coreos.com"]
  resources: ["servicemonitors"]
  verbs: ["get", "list", "watch", "create", "update", "patch", "delete"]
- apiGroups: ["", "events.k8s.io"]
  resources: ["events"]
  verbs: ["create", "patch"]
{{- end }}
