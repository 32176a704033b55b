{{/*
Names, labels and the settings every component shares. Every helper is prefixed "pdserve.".
*/}}

{{- define "pdserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full name of the release's objects; components append "-router", "-prefill"... */}}
{{- define "pdserve.fullname" -}}
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

{{- define "pdserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels on every object. */}}
{{- define "pdserve.labels" -}}
helm.sh/chart: {{ include "pdserve.chart" . }}
{{ include "pdserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: pdserve
{{- end }}

{{- define "pdserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pdserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Labels of one component: (dict "root" $ "component" "router"). */}}
{{- define "pdserve.componentLabels" -}}
{{ include "pdserve.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- with .root.Values.pdserveModel }}
pdserve.io/model: {{ . }}
{{- end }}
{{- end }}

{{- define "pdserve.componentSelectorLabels" -}}
{{ include "pdserve.selectorLabels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* The component of a role's engines: the role, `<role>-<name>` for an entry of `models`
(engines.yaml), so that no two models' workloads select each other's pods; the first model's
keep a chart of one model's labels. */}}
{{- define "pdserve.engine.component" -}}
{{ .role }}{{ with .root.Values.pdserveModel }}-{{ . }}{{ end }}
{{- end }}

{{- define "pdserve.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "pdserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "pdserve.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
Where and as whom a pod runs, under its spec: (dict "root" $ "placement" <the component's values>
"serviceAccount" true|false). The release's imagePullSecrets, and the component's
priorityClassName, nodeSelector, tolerations and affinity when set.
*/}}
{{- define "pdserve.podPlacement" -}}
{{- if .serviceAccount }}
serviceAccountName: {{ include "pdserve.serviceAccountName" .root }}
{{- end }}
{{- with .root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .placement.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with .placement.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .placement.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .placement.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* Control-plane key prefix: the release name unless set. */}}
{{- define "pdserve.controlPlaneNamespace" -}}
{{- default .Release.Name .Values.controlPlane.namespace }}
{{- end }}

{{- define "pdserve.redis.fullname" -}}
{{- printf "%s-redis" (include "pdserve.fullname" .) }}
{{- end }}

{{- define "pdserve.redis.url" -}}
{{- if eq .Values.redis.mode "external" }}
{{- .Values.redis.external.url }}
{{- else }}
{{- printf "redis://%s:%d/0" (include "pdserve.redis.fullname" .) (int .Values.redis.bundled.port) }}
{{- end }}
{{- end }}

{{/* The Secret and key holding the Redis password, whichever mode. */}}
{{- define "pdserve.redis.secretName" -}}
{{- if eq .Values.redis.mode "external" }}
{{- .Values.redis.external.existingSecret }}
{{- else }}
{{- default (include "pdserve.redis.fullname" .) .Values.redis.bundled.auth.existingSecret }}
{{- end }}
{{- end }}

{{- define "pdserve.redis.secretKey" -}}
{{- if eq .Values.redis.mode "external" }}
{{- .Values.redis.external.existingSecretPasswordKey }}
{{- else }}
{{- .Values.redis.bundled.auth.existingSecretPasswordKey }}
{{- end }}
{{- end }}

{{- define "pdserve.redis.caMountPath" -}}/etc/pdserve/redis-ca{{- end }}

{{- define "pdserve.redis.usesCa" -}}
{{- if and (eq .Values.redis.mode "external") .Values.redis.external.tls.caSecret }}true{{ end }}
{{- end }}

{{/*
Environment every pdserve process reads (services/cli/settings.py, nested with "__").
*/}}
{{- define "pdserve.controlPlaneEnv" -}}
- name: PDSERVE_CONTROL_PLANE__REDIS__URL
  value: {{ include "pdserve.redis.url" . | quote }}
- name: PDSERVE_CONTROL_PLANE__REDIS__PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "pdserve.redis.secretName" . }}
      key: {{ include "pdserve.redis.secretKey" . }}
{{- if and (eq .Values.redis.mode "external") .Values.redis.external.username }}
- name: PDSERVE_CONTROL_PLANE__REDIS__USERNAME
  value: {{ .Values.redis.external.username | quote }}
{{- end }}
{{- if and (eq .Values.redis.mode "external") .Values.redis.external.tls.enabled }}
- name: PDSERVE_CONTROL_PLANE__REDIS__TLS
  value: "true"
{{- end }}
{{- if include "pdserve.redis.usesCa" . }}
- name: PDSERVE_CONTROL_PLANE__REDIS__TLS_CA_FILE
  value: {{ printf "%s/ca.crt" (include "pdserve.redis.caMountPath" .) | quote }}
{{- end }}
- name: PDSERVE_CONTROL_PLANE__NAMESPACE
  value: {{ include "pdserve.controlPlaneNamespace" . | quote }}
- name: PDSERVE_CONTROL_PLANE__LEASE_TTL_S
  value: {{ .Values.controlPlane.leaseTtlSeconds | quote }}
- name: PDSERVE_CONTROL_PLANE__HEARTBEAT_INTERVAL_S
  value: {{ .Values.controlPlane.heartbeatIntervalSeconds | quote }}
{{- end }}

{{/* Volumes every pdserve pod mounts: the model and, with a private CA, the Redis CA. */}}
{{- define "pdserve.sharedVolumes" -}}
{{- if .Values.model.volume }}
- name: model
  {{- toYaml .Values.model.volume | nindent 2 }}
{{- end }}
{{- if include "pdserve.redis.usesCa" . }}
- name: redis-ca
  secret:
    secretName: {{ .Values.redis.external.tls.caSecret }}
{{- end }}
{{- end }}

{{- define "pdserve.sharedVolumeMounts" -}}
{{- if .Values.model.volume }}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
{{- end }}
{{- if include "pdserve.redis.usesCa" . }}
- name: redis-ca
  mountPath: {{ include "pdserve.redis.caMountPath" . }}
  readOnly: true
{{- end }}
{{- end }}

{{/* The planner's objects: <fullname>-planner (Deployment, Service, ConfigMap). */}}
{{- define "pdserve.planner.fullname" -}}
{{- printf "%s-planner" (include "pdserve.fullname" .) }}
{{- end }}

{{- define "pdserve.planner.serviceAccountName" -}}
{{- if .Values.planner.serviceAccount.create }}
{{- default (include "pdserve.planner.fullname" .) .Values.planner.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.planner.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Whether the planner's autoscalers own a role's replicas: (dict "root" $ "role" "prefill"). */}}
{{- define "pdserve.planner.scales" -}}
{{- if and .root.Values.planner.enabled (index .root.Values .role).enabled }}true{{ end }}
{{- end }}
