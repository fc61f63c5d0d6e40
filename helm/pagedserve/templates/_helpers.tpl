{{/* Names and labels ---------------------------------------------------------------------- */}}

{{- define "pagedserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
<release>-pagedserve, or <release> when it already says pagedserve. At most 40 characters:
names append -scheduler or -worker-<rank>, and a StatefulSet's pods carry a label holding
their name plus a revision hash, which must stay within 63.
*/}}
{{- define "pagedserve.fullname" -}}
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

{{/* (dict "root" $ "component" "worker") */}}
{{- define "pagedserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pagedserve.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "pagedserve.labels" -}}
{{ include "pagedserve.selectorLabels" . }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
{{- end }}

{{- define "pagedserve.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{/* Addresses ------------------------------------------------------------------------------ */}}

{{/*
The headless engine Service: its DNS name resolves to every ready engine pod, whose scheduler
listens on scheduler.port. The gateways' --scheduler-address.
*/}}
{{- define "pagedserve.schedulerAddress" -}}
{{ include "pagedserve.fullname" . }}-engine.{{ .Release.Namespace }}.svc.{{ .Values.clusterDomain }}:{{ .Values.scheduler.port }}
{{- end }}

{{- define "pagedserve.tensorParallelSize" -}}
{{- $tp := int .Values.engine.tensorParallelSize }}
{{- if lt $tp 1 }}
{{- fail (printf "engine.tensorParallelSize must be >= 1, got %v" .Values.engine.tensorParallelSize) }}
{{- end }}
{{- $tp }}
{{- end }}

{{/* One worker-addresses entry per rank: the pod's loopback, port worker.port + rank. */}}
{{- define "pagedserve.workerAddresses" -}}
{{- $addresses := list }}
{{- range $rank := until (include "pagedserve.tensorParallelSize" . | int) }}
{{- $addresses = append $addresses (printf "127.0.0.1:%d" (add $.Values.worker.port $rank)) }}
{{- end }}
{{- toYaml $addresses }}
{{- end }}

{{/* Engine values that are chart settings rather than flags. */}}
{{- define "pagedserve.engineFlags" -}}
{{ include "pagedserve.flags" (omit .Values.engine "replicas" "prefillReplicas" "gpuResource" "shmSizeLimit" "pod" "podDisruptionBudget" "autoscaling") }}
{{- end }}

{{- define "pagedserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- .Values.serviceAccount.name | default (include "pagedserve.fullname" .) }}
{{- else }}
{{- .Values.serviceAccount.name | default "default" }}
{{- end }}
{{- end }}

{{/* Flags ---------------------------------------------------------------------------------- */}}

{{/*
A YAML number arrives as a float64, which prints 1048576 as 1.048576e+06: print whole numbers
as integers.
*/}}
{{- define "pagedserve.scalar" -}}
{{- if and (kindIs "float64" .) (eq . (floor .)) }}{{ int64 . }}{{ else }}{{ . }}{{ end }}
{{- end }}

{{/*
CLI flags from a map of camelCase keys (the config dataclasses' fields): `fooBar: x` is
--foo-bar x, a boolean is --foo-bar / --no-foo-bar, null and "" keep the CLI default.
*/}}
{{- define "pagedserve.flags" -}}
{{- $args := list }}
{{- range $key, $value := . }}
{{- $flag := kebabcase $key }}
{{- if kindIs "bool" $value }}
{{- $args = append $args (printf "--%s%s" (ternary "" "no-" $value) $flag) }}
{{- else if and (not (kindIs "invalid" $value)) (ne (toString $value) "") }}
{{- $args = concat $args (list (printf "--%s" $flag) (include "pagedserve.scalar" $value)) }}
{{- end }}
{{- end }}
{{- with $args }}{{ toYaml . }}{{ end }}
{{- end }}

{{/* Flags every service takes: (dict "root" $ "port" <its port> "metricsPort" <its metrics port>). */}}
{{- define "pagedserve.serviceFlags" -}}
{{- $tracing := .root.Values.tracing }}
{{- if and $tracing.otelEndpoint (ne $tracing.otelExporter "otlp") (ne $tracing.otelExporter "") }}
{{- fail (printf "tracing.otelEndpoint is only used with tracing.otelExporter=otlp, got otelExporter=%s" $tracing.otelExporter) }}
{{- end -}}
- --host
- {{ .root.Values.listenHost | quote }}
- --port
- {{ .port | quote }}
- --log-level
- {{ .root.Values.logLevel | quote }}
- --drain-timeout-s
- {{ include "pagedserve.scalar" .root.Values.drainTimeoutS | quote }}
{{- if .root.Values.metrics.enabled }}
- --metrics-port
- {{ .metricsPort | default .root.Values.metrics.port | quote }}
{{- end }}
{{ include "pagedserve.flags" $tracing }}
{{- end }}

{{/* TLS ------------------------------------------------------------------------------------ */}}

{{/*
The internal certificate's Secret of one role (gateway, scheduler, worker):
<tls.internal.secretName or <fullname>-internal-tls>-<role>. (dict "root" $ "role" <role>).
*/}}
{{- define "pagedserve.internalTlsSecret" -}}
{{ printf "%s-%s" (.root.Values.tls.internal.secretName | default (printf "%s-internal-tls" (include "pagedserve.fullname" .root))) .role }}
{{- end }}

{{/*
Internal mTLS flags every service takes; `tls`: whether the service's own port has TLS, so that
its probes need the plaintext health port: (dict "root" $ "tls" <bool> "healthPort" <port>).
*/}}
{{- define "pagedserve.tlsFlags" -}}
{{- $internal := .root.Values.tls.internal }}
{{- if $internal.enabled }}
- --internal-tls-dir
- {{ $internal.mountPath | quote }}
{{- with $internal.serverName }}
- --tls-server-name
- {{ . | quote }}
{{- end }}
{{- end }}
{{- if .tls }}
- --health-port
- {{ .healthPort | default .root.Values.tls.healthPort | quote }}
{{- end }}
{{- end }}

{{/* One volume per role a pod runs, each container mounting its own: (dict "root" $ "role" <role>). */}}
{{- define "pagedserve.internalTlsVolume" -}}
{{- if .root.Values.tls.internal.enabled }}
- name: internal-tls-{{ .role }}
  secret:
    secretName: {{ include "pagedserve.internalTlsSecret" . | quote }}
{{- end }}
{{- end }}

{{- define "pagedserve.internalTlsVolumeMount" -}}
{{- if .root.Values.tls.internal.enabled }}
- name: internal-tls-{{ .role }}
  mountPath: {{ .root.Values.tls.internal.mountPath | quote }}
  readOnly: true
{{- end }}
{{- end }}

{{/*
The health port's containerPort, when the service's port has TLS:
(dict "root" $ "tls" <bool> "healthPort" <port> "suffix" <port-name suffix>).
*/}}
{{- define "pagedserve.healthContainerPort" -}}
{{- if .tls }}
- name: health{{ .suffix }}
  containerPort: {{ .healthPort | default .root.Values.tls.healthPort }}
  protocol: TCP
{{- end }}
{{- end }}

{{/* Pods ----------------------------------------------------------------------------------- */}}

{{/*
SIGTERM: drain for drainTimeoutS, then server.stop with the same grace, plus a margin. Ranks
wait drainTimeoutS + 5 (preStop) first, so that they outlive their scheduler's drain.
*/}}
{{- define "pagedserve.terminationGracePeriodSeconds" -}}
{{- $drain := ceil .root.Values.drainTimeoutS | int }}
{{- add (mul 2 $drain) 15 (.preStopSeconds | default 0) }}
{{- end }}

{{- define "pagedserve.rankPreStopSeconds" -}}
{{- add (ceil .Values.drainTimeoutS | int) 5 }}
{{- end }}

{{/* Pod spec fields both workloads share: (dict "root" $ "values" <pod settings> "preStopSeconds" <n>). */}}
{{- define "pagedserve.podCommon" -}}
terminationGracePeriodSeconds: {{ include "pagedserve.terminationGracePeriodSeconds" . }}
serviceAccountName: {{ include "pagedserve.serviceAccountName" .root }}
automountServiceAccountToken: {{ .root.Values.serviceAccount.automountServiceAccountToken }}
enableServiceLinks: false
{{- with .root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .root.Values.podSecurityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.runtimeClassName }}
runtimeClassName: {{ . }}
{{- end }}
{{- with .values.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with .values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* Container fields every container shares: image, security context. */}}
{{- define "pagedserve.containerCommon" -}}
image: {{ include "pagedserve.image" . | quote }}
imagePullPolicy: {{ .Values.image.pullPolicy }}
{{- with .Values.securityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/*
The writable directories of a read-only root filesystem: caches (HF, Triton's compiled kernels,
torch) and /tmp, as emptyDirs.
*/}}
{{- define "pagedserve.scratchVolumes" -}}
- name: cache
  emptyDir:
    sizeLimit: {{ .Values.cacheSizeLimit }}
- name: tmp
  emptyDir:
    sizeLimit: {{ .Values.tmpSizeLimit }}
{{- end }}

{{- define "pagedserve.scratchVolumeMounts" -}}
- name: cache
  mountPath: /cache
- name: tmp
  mountPath: /tmp
{{- end }}

{{/* The container's env: pod identity (the worker's rank, span resources) and extraEnv. */}}
{{- define "pagedserve.env" -}}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
- name: OTEL_RESOURCE_ATTRIBUTES
  value: k8s.pod.name=$(POD_NAME),k8s.namespace.name=$(POD_NAMESPACE)
- name: HOME
  value: /cache
- name: XDG_CACHE_HOME
  value: /cache
- name: HF_HOME
  value: /cache/huggingface
- name: TRITON_CACHE_DIR
  value: /cache/triton
- name: TORCHINDUCTOR_CACHE_DIR
  value: /cache/torchinductor
{{- range $name, $value := .Values.otelEnv }}
- name: {{ $name }}
  value: {{ $value | toString | quote }}
{{- end }}
{{- with .Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "pagedserve.envFrom" -}}
{{- with .Values.extraEnvFrom }}
envFrom:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* Pod annotations: the component's own, and Prometheus' scrape annotations. */}}
{{- define "pagedserve.podAnnotations" -}}
{{- $annotations := dict }}
{{- if and .root.Values.metrics.enabled .root.Values.metrics.podAnnotations }}
{{- $_ := set $annotations "prometheus.io/scrape" "true" }}
{{- $_ := set $annotations "prometheus.io/port" (toString .root.Values.metrics.port) }}
{{- $_ := set $annotations "prometheus.io/path" "/metrics" }}
{{- end }}
{{- $annotations = merge (deepCopy (default (dict) .values.podAnnotations)) $annotations }}
{{- with $annotations }}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* The container's metrics port, when on: (dict "root" $ "port" <port> "name" <port name>). */}}
{{- define "pagedserve.metricsContainerPort" -}}
{{- if .root.Values.metrics.enabled }}
- name: {{ .name | default "metrics" }}
  containerPort: {{ .port | default .root.Values.metrics.port }}
  protocol: TCP
{{- end }}
{{- end }}

{{/*
Startup and readiness: gRPC health on the port the service listens on, or on the plaintext
health port when that port has TLS. Liveness: a TCP connect to that port, so that a service
NOT_SERVING for a while (a worker rebuilding its cache) is taken out of rotation, not killed.
(dict "root" $ "port" <its port> "tls" <bool> "healthPort" <its health port>).
Kubernetes calls grpc.health.v1.Health/Check for the whole server ("").
*/}}
{{- define "pagedserve.probes" -}}
{{- $port := ternary (.healthPort | default .root.Values.tls.healthPort) .port (.tls | default false) }}
startupProbe:
  grpc:
    port: {{ $port }}
  {{- toYaml .root.Values.probes.startup | nindent 2 }}
readinessProbe:
  grpc:
    port: {{ $port }}
  {{- toYaml .root.Values.probes.readiness | nindent 2 }}
livenessProbe:
  tcpSocket:
    port: {{ $port }}
  {{- toYaml .root.Values.probes.liveness | nindent 2 }}
{{- end }}

{{/* The model folder's volume, read-only. */}}
{{- define "pagedserve.modelVolume" -}}
{{- if not (hasPrefix (printf "%s/" (trimSuffix "/" .Values.model.mountPath)) .Values.model.path) }}
{{- fail (printf "model.path must lie under model.mountPath, got path=%s mountPath=%s" .Values.model.path .Values.model.mountPath) }}
{{- end -}}
- name: model
  {{- if .Values.model.hostPath }}
  hostPath:
    path: {{ .Values.model.hostPath | quote }}
    type: Directory
  {{- else }}
  persistentVolumeClaim:
    claimName: {{ required "model.existingClaim or model.hostPath must hold the model folder" .Values.model.existingClaim | quote }}
    readOnly: {{ not .Values.model.download.enabled }}
  {{- end }}
{{- end }}

{{- define "pagedserve.modelVolumeMount" -}}
- name: model
  mountPath: {{ .Values.model.mountPath | quote }}
  readOnly: true
{{- end }}

{{/* The Deployment's / StatefulSet's replica count, unless an autoscaler owns it. */}}
{{- define "pagedserve.replicas" -}}
{{- if lt (int .replicas) 0 }}
{{- fail (printf "%s must be >= 0, got %v" .name .replicas) }}
{{- end }}
{{- if not .autoscaled }}
replicas: {{ .replicas }}
{{- end }}
{{- end }}
