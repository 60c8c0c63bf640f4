{{/* Chart name, truncated to the 63 characters of a DNS label. */}}
{{- define "pagedinfer-operator.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full name: release-chart unless the release name already contains the chart name. */}}
{{- define "pagedinfer-operator.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "pagedinfer-operator.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "pagedinfer-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pagedinfer-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "pagedinfer-operator.labels" -}}
helm.sh/chart: {{ include "pagedinfer-operator.chart" . }}
{{ include "pagedinfer-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: paged-infer
{{- end }}

{{- define "pagedinfer-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "pagedinfer-operator.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* image reference: a digest wins over a tag; the tag defaults to appVersion. */}}
{{- define "pagedinfer-operator.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/* Namespaces watched when not cluster-wide (the release namespace by default). */}}
{{- define "pagedinfer-operator.watchNamespaces" -}}
{{- if .Values.operator.watchNamespaces }}
{{- join "," (uniq .Values.operator.watchNamespaces) }}
{{- else }}
{{- .Release.Namespace }}
{{- end }}
{{- end }}

{{/*
Matchers of the engines' scrape targets for the EngineDown alert: the user's; else the job of
the chart's PodMonitor (Prometheus Operator: <namespace>/<name>); else what every engine
target carries however it is scraped (per-engine ServiceMonitors): container "engine", port "http".
*/}}
{{- define "pagedinfer-operator.engineTargetSelector" -}}
{{- if .Values.prometheusRule.engineTargetSelector }}
{{- .Values.prometheusRule.engineTargetSelector }}
{{- else if .Values.engineMonitor.enabled }}
{{- printf "job=\"%s/%s-engines\"" .Release.Namespace (include "pagedinfer-operator.fullname" .) }}
{{- else }}
{{- printf "container=\"engine\", endpoint=\"%s\"" .Values.engineMonitor.portName }}
{{- end }}
{{- end }}

{{- define "pagedinfer-operator.operatorTargetSelector" -}}
{{- printf "job=\"%s-metrics\", namespace=\"%s\"" (include "pagedinfer-operator.fullname" .) .Release.Namespace }}
{{- end }}
