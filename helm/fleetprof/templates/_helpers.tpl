{{/* Names and labels shared by every template. */}}

{{- define "fleetprof.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Object name prefix: the release name, with the chart name appended unless it is already there. */}}
{{- define "fleetprof.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := include "fleetprof.name" . -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "fleetprof.agentName" -}}
{{- printf "%s-agent" (include "fleetprof.fullname" .) -}}
{{- end -}}

{{- define "fleetprof.collectorName" -}}
{{- printf "%s-collector" (include "fleetprof.fullname" .) -}}
{{- end -}}

{{/* Selector labels; templates add app.kubernetes.io/component themselves. */}}
{{- define "fleetprof.selectorLabels" -}}
app.kubernetes.io/name: {{ include "fleetprof.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "fleetprof.labels" -}}
{{ include "fleetprof.selectorLabels" . }}
app.kubernetes.io/part-of: fleetprof
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "fleetprof.collectorAddress" -}}
{{- if .Values.agent.collectorAddress -}}
{{- .Values.agent.collectorAddress -}}
{{- else -}}
{{- printf "%s.%s.svc:%v" (include "fleetprof.collectorName" .) .Release.Namespace .Values.collector.grpcPort -}}
{{- end -}}
{{- end -}}
