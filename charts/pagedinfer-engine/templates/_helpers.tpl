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

{{/* The CPU sample, manifests/samples/smollm2-cpu.yaml (a test keeps them equal). */}}
{{- define "pagedinfer-engine.sampleSpec" -}}
model:
  uri: builtin://smollm2-135m
  servedName: smollm2-135m
replicas: 1
resources:
  gpus: 0
  cpu: "1"
  memory: 4Gi
engine:
  maxNumSeqs: 16
  maxModelLen: 2048
lifecycle:
  startupTimeoutSeconds: 300
{{- end }}

{{/*
The spec: every value except the metadata keys (the schema admits only spec fields). Without
model.uri, the values go on top of the CPU sample; with it, they are the whole spec.
*/}}
{{- define "pagedinfer-engine.spec" -}}
{{- $spec := omit .Values "name" "labels" "annotations" "global" }}
{{- if not (dig "model" "uri" "" $spec) }}
{{- $spec = mergeOverwrite (include "pagedinfer-engine.sampleSpec" . | fromYaml) $spec }}
{{- end }}
{{- toYaml $spec }}
{{- end }}
