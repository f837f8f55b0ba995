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

{{/* The collector Service's DNS name, which its certificate is for and agents check it against. */}}
{{- define "fleetprof.collectorHost" -}}
{{- printf "%s.%s.svc" (include "fleetprof.collectorName" .) .Release.Namespace -}}
{{- end -}}

{{- define "fleetprof.collectorAddress" -}}
{{- if .Values.agent.collectorAddress -}}
{{- .Values.agent.collectorAddress -}}
{{- else -}}
{{- printf "%s:%v" (include "fleetprof.collectorHost" .) .Values.collector.grpcPort -}}
{{- end -}}
{{- end -}}

{{- define "fleetprof.collectorURL" -}}
{{- printf "%s://%s:%v" (ternary "https" "http" .Values.tls.enabled) (include "fleetprof.collectorHost" .) .Values.collector.httpPort -}}
{{- end -}}

{{/* The Secrets the tokens are in: the user's, or the ones templates/secrets.yaml generates. */}}
{{- define "fleetprof.ingestTokenSecret" -}}
{{- .Values.auth.ingestToken.existingSecret | default (printf "%s-ingest-token" (include "fleetprof.fullname" .)) -}}
{{- end -}}

{{- define "fleetprof.apiTokenSecret" -}}
{{- .Values.auth.apiToken.existingSecret | default (printf "%s-api-token" (include "fleetprof.fullname" .)) -}}
{{- end -}}

{{/*
A generated token, base64 as Secret data: the one already in the cluster's Secret (.name, key .key), so
`helm upgrade` keeps it, else 48 fresh random characters. `lookup` finds nothing under `helm template`
and `--dry-run`: there every render draws a new token. `get` rather than `.data`: `helm lint --strict`
refuses a missing map key.
*/}}
{{- define "fleetprof.token" -}}
{{- $found := lookup "v1" "Secret" .namespace .name | default dict -}}
{{- $data := get $found "data" | default dict -}}
{{- get $data .key | default (randAlphaNum 48 | b64enc) -}}
{{- end -}}

{{/* The collector's TLS Secret (tls.crt, tls.key, ca.crt): the user's, or the one cert-manager writes. */}}
{{- define "fleetprof.tlsSecret" -}}
{{- .Values.tls.existingSecret | default (printf "%s-tls" (include "fleetprof.collectorName" .)) -}}
{{- end -}}

{{/* The agents' client certificate Secret (mutual TLS): the user's, or the one cert-manager writes. */}}
{{- define "fleetprof.agentTlsSecret" -}}
{{- .Values.tls.mutual.existingSecret | default (printf "%s-tls" (include "fleetprof.agentName" .)) -}}
{{- end -}}

{{- define "fleetprof.tlsServerName" -}}
{{- .Values.tls.serverName | default (include "fleetprof.collectorHost" .) -}}
{{- end -}}
