{{/* Name of the InferenceEngine: .Values.name, else the release name (DNS-1035, <= 50). */}}
{{- define "pagedinfer-engine.name" -}}
{{- default .Release.Name .Values.name | trunc 50 | trimSuffix "-" }}
{{- end }}

{{- define "pagedinfer-engine.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "pagedinfer-engine.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "pagedinfer-engine.labels" -}}
helm.sh/chart: {{ include "pagedinfer-engine.chart" . }}
{{ include "pagedinfer-engine.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: paged-infer
{{- end }}

{{/* The spec: every value except the metadata keys (the schema admits only spec fields). */}}
{{- define "pagedinfer-engine.spec" -}}
{{- toYaml (omit .Values "name" "labels" "annotations" "global") }}
{{- end }}
