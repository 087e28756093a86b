{{/* Chart name, truncated to a DNS label. */}}
{{- define "loraplex.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full name prefix of every resource. */}}
{{- define "loraplex.fullname" -}}
{{- /* 40 characters: suffixes such as -dashboard-experiment must fit in 63. */}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "loraplex.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels on every resource. */}}
{{- define "loraplex.labels" -}}
helm.sh/chart: {{ include "loraplex.chart" . }}
app.kubernetes.io/name: {{ include "loraplex.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: loraplex
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Selector labels of the operator pod. */}}
{{- define "loraplex.operatorSelectorLabels" -}}
app.kubernetes.io/name: {{ include "loraplex.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "loraplex.gatewaySelectorLabels" -}}
app.kubernetes.io/name: {{ include "loraplex.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: gateway
{{- end }}

{{- define "loraplex.gatewayLabels" -}}
{{ include "loraplex.labels" . }}
app.kubernetes.io/component: gateway
{{- end }}

{{- define "loraplex.gatewayServiceAccountName" -}}
{{- if .Values.gateway.serviceAccount.create }}
{{- default (printf "%s-gateway" (include "loraplex.fullname" .)) .Values.gateway.serviceAccount.name }}
{{- else }}
{{- required "gateway.serviceAccount.name is required when gateway.serviceAccount.create is false" .Values.gateway.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "loraplex.operatorLabels" -}}
{{ include "loraplex.labels" . }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "loraplex.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "loraplex.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Namespace of the engine pods and the engine token Secret. */}}
{{- define "loraplex.engineNamespace" -}}
{{- default .Release.Namespace .Values.engines.namespace }}
{{- end }}

{{/* Name of the Secret holding the engine API token. */}}
{{- define "loraplex.tokenSecretName" -}}
{{- default (printf "%s-engine-token" (include "loraplex.fullname" .)) .Values.engines.token.existingSecret }}
{{- end }}

{{/* Operator image reference: repository@digest, else repository:tag (default appVersion). */}}
{{- define "loraplex.operatorImage" -}}
{{- $img := .Values.operator.image }}
{{- if $img.digest }}
{{- printf "%s@%s" $img.repository $img.digest }}
{{- else }}
{{- printf "%s:%s" $img.repository (default .Chart.AppVersion $img.tag) }}
{{- end }}
{{- end }}

{{/* Namespaces served in rbac.scope=namespaced, sorted and de-duplicated. */}}
{{- define "loraplex.watchNamespaces" -}}
{{- .Values.rbac.namespaces | uniq | sortAlpha | join "," }}
{{- end }}

{{/* The namespaces whose API key Secrets the gateway reads and where it writes Tinker
models' experiments, comma-joined: gateway.keys.namespaces, or the release namespace when
none is listed; empty only with gateway.keys.allNamespaces (the ClusterRole). */}}
{{- define "loraplex.gatewayKeyNamespaces" -}}
{{- $keys := .Values.gateway.keys }}
{{- if $keys.allNamespaces }}
{{- if $keys.namespaces }}
{{- fail "gateway.keys.allNamespaces=true reads keys in every namespace: leave gateway.keys.namespaces empty" }}
{{- end }}
{{- else }}
{{- $keys.namespaces | default (list .Release.Namespace) | uniq | sortAlpha | join "," }}
{{- end }}
{{- end }}

{{/* The vLLM serving fleet (fleet.enabled, templates/fleet.yaml). */}}
{{- define "loraplex.fleetSelectorLabels" -}}
app.kubernetes.io/name: {{ include "loraplex.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: fleet
{{- end }}

{{- define "loraplex.fleetLabels" -}}
{{ include "loraplex.labels" . }}
app.kubernetes.io/component: fleet
{{- end }}
