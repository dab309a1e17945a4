{{/*
Named templates of the blkplane chart: resource names, labels, the image, and the paths and
arguments that several manifests share.
*/}}

{{/* The chart name, or nameOverride. */}}
{{- define "blkplane.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The full name of every resource: fullnameOverride, or RELEASE-CHART (just RELEASE when it
already contains the chart name), at most 63 characters.
*/}}
{{- define "blkplane.fullname" -}}
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

{{/* CHART-VERSION, for the helm.sh/chart label. */}}
{{- define "blkplane.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels of every resource. */}}
{{- define "blkplane.labels" -}}
helm.sh/chart: {{ include "blkplane.chart" . }}
{{ include "blkplane.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: node-daemon
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* The labels the DaemonSet and the metrics Service select pods by. */}}
{{- define "blkplane.selectorLabels" -}}
app.kubernetes.io/name: {{ include "blkplane.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* The ServiceAccount of the pods. */}}
{{- define "blkplane.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "blkplane.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* REPOSITORY:TAG of the image (the tag defaults to the chart's appVersion). */}}
{{- define "blkplane.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* blkplaned's gRPC control socket: RUNTIME_DIR/control.sock (its default --listen). */}}
{{- define "blkplane.controlSocket" -}}
{{- printf "%s/control.sock" (trimSuffix "/" .Values.paths.runtimeDir) }}
{{- end }}

{{/* ADDR:PORT of --metrics-listen, with an IPv6 address in brackets. */}}
{{- define "blkplane.metricsListen" -}}
{{- $addr := toString .Values.metrics.listenAddress }}
{{- if contains ":" $addr }}
{{- printf "[%s]:%d" $addr (int .Values.metrics.port) }}
{{- else }}
{{- printf "%s:%d" $addr (int .Values.metrics.port) }}
{{- end }}
{{- end }}

{{/* The probes' command: a grpc.health.v1 Check through blkplanectl (exit 0 when SERVING). */}}
{{- define "blkplane.healthCommand" -}}
exec:
  command:
    - /usr/local/bin/blkplanectl
    - --socket
    - {{ include "blkplane.controlSocket" . | quote }}
    - health
{{- end }}

{{/*
The blkplaned container's seccompProfile: the values' type, with localhostProfile only for
Localhost (the API refuses it with any other type).
*/}}
{{- define "blkplane.seccompProfile" -}}
type: {{ .Values.seccompProfile.type }}
{{- if eq .Values.seccompProfile.type "Localhost" }}
localhostProfile: {{ required "seccompProfile.localhostProfile is needed with type Localhost" .Values.seccompProfile.localhostProfile | quote }}
{{- end }}
{{- end }}

{{/* Whether the metrics Service is created ("true" or empty). */}}
{{- define "blkplane.metricsService" -}}
{{- if and .Values.metrics.enabled (or .Values.metrics.service.enabled .Values.metrics.serviceMonitor.enabled) }}true{{ end }}
{{- end }}
