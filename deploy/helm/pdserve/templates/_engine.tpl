{{/*
The one pod helper shared by prefill and decode. Both roles have the same values shape; every
template receives (dict "root" $ "role" "prefill"|"decode" "member" "single"|"leader"|"worker"):

  single  one pod is one whole engine (StatefulSet): runs `pdserve <role>`.
  leader  first pod of a LeaderWorkerSet group: Ray head, then `pdserve <role>` once every node
          of the group has joined; vLLM places the PP x TP workers over the Ray cluster.
  worker  other pods of the group: a Ray worker that hosts GPU workers (and their NIXL agents).
*/}}

{{/* GPUs one pod of this role requests. */}}
{{- define "pdserve.engine.gpusPerPod" -}}
{{- $r := index .root.Values .role }}
{{- if or (ne $r.engine "vllm") (and (hasKey $r.gpu "enabled") (not $r.gpu.enabled)) }}0
{{- else if $r.multiNode.enabled }}{{ div (mul (int $r.pp) (int $r.tp)) (int $r.multiNode.nodes) }}
{{- else }}{{ mul (int $r.pp) (int $r.tp) }}
{{- end }}
{{- end }}

{{/*
Seconds an engine may take to stop after SIGTERM: its drain, then the leases of the KV it handed
out. The preStop hook waits this long, the grace period exceeds it, and _validate.tpl checks an
explicit grace period against it.
*/}}
{{- define "pdserve.engine.drainBound" -}}
{{- $r := index .root.Values .role }}
{{- add (int $r.drain.timeoutSeconds) (int $r.kvLeaseSeconds) }}
{{- end }}

{{/* Seconds the kubelet waits after preStop/SIGTERM: drain, then KV leases, then a margin. */}}
{{- define "pdserve.engine.gracePeriod" -}}
{{- $r := index .root.Values .role }}
{{- if kindIs "invalid" $r.terminationGracePeriodSeconds }}
{{- add (int (include "pdserve.engine.drainBound" .)) (int $r.drain.gracePeriodMarginSeconds) }}
{{- else }}
{{- int $r.terminationGracePeriodSeconds }}
{{- end }}
{{- end }}

{{/* `pdserve <role>` arguments as a YAML list; the advertise address is added by the caller. */}}
{{- define "pdserve.engine.args" -}}
{{- $r := index .root.Values .role }}
{{- $args := list .role
    "--model" .root.Values.model.path
    "--engine" $r.engine
    "--pp" (toString $r.pp)
    "--tp" (toString $r.tp)
    "--listen" (printf "0.0.0.0:%d" (int $r.grpcPort))
    "--metrics-port" (toString $r.metricsPort)
    "--drain-timeout-s" (toString $r.drain.timeoutSeconds)
    "--kv-lease-s" (toString $r.kvLeaseSeconds)
    "--ready-timeout-s" (toString $r.readyTimeoutSeconds) }}
{{- if include "pdserve.lora.enabled" .root }}
{{- $l := .root.Values.lora }}
{{- $args = concat $args (list "--enable-lora" "--max-loras" (toString $l.maxLoras) "--max-lora-rank" (toString $l.maxLoraRank)) }}
{{- if gt (int $l.maxCpuLoras) 0 }}{{ $args = concat $args (list "--max-cpu-loras" (toString $l.maxCpuLoras)) }}{{ end }}
{{- if $l.modules }}{{ $args = append $args "--lora-modules" }}{{ range $l.modules }}{{ $args = append $args (printf "%s=%s" .name .path) }}{{ end }}{{ end }}
{{- end }}
{{- range $r.extraArgs }}{{ $args = append $args (toString .) }}{{ end }}
{{- toYaml $args }}
{{- end }}

{{/* "true" when LoRA adapters are served (lora.enabled, or lora.modules given), else "". */}}
{{- define "pdserve.lora.enabled" -}}
{{- if or .Values.lora.enabled .Values.lora.modules }}true{{ end }}
{{- end }}

{{/* Resources: the role's resources plus GPUs and RDMA devices as limits. */}}
{{- define "pdserve.engine.resources" -}}
{{- $r := index .root.Values .role }}
{{- $res := deepCopy (default dict $r.resources) }}
{{- $limits := deepCopy (default dict $res.limits) }}
{{- $gpus := int (include "pdserve.engine.gpusPerPod" .) }}
{{- if gt $gpus 0 }}{{ $_ := set $limits $r.gpu.resourceName $gpus }}{{ end }}
{{- range $name, $count := $r.rdma.resources }}{{ $_ := set $limits $name $count }}{{ end }}
{{- if $limits }}{{ $_ := set $res "limits" $limits }}{{ end }}
{{- toYaml $res }}
{{- end }}

{{/* UCX_* variables of the NIXL agents; empty values are left to UCX. */}}
{{- define "pdserve.engine.ucxEnv" -}}
{{- $ucx := (index .root.Values .role).ucx }}
{{- if $ucx.tls }}
- name: UCX_TLS
  value: {{ $ucx.tls | quote }}
{{- end }}
{{- if $ucx.netDevices }}
- name: UCX_NET_DEVICES
  value: {{ $ucx.netDevices | quote }}
{{- end }}
{{- if $ucx.ibGidIndex }}
- name: UCX_IB_GID_INDEX
  value: {{ $ucx.ibGidIndex | quote }}
{{- end }}
{{- range $name, $value := $ucx.extraEnv }}
- name: {{ $name }}
  value: {{ $value | quote }}
{{- end }}
{{- end }}

{{/* Container command and args per member. */}}
{{- define "pdserve.engine.command" -}}
{{- $r := index .root.Values .role }}
{{- $args := include "pdserve.engine.args" . | fromYamlArray }}
{{- $advertise := printf ":%d" (int $r.grpcPort) }}
{{- if eq .member "single" }}
command: ["pdserve"]
args:
  {{- toYaml (concat $args (list "--engine-id" "$(POD_NAME)" "--advertise" (printf "$(POD_IP)%s" $advertise))) | nindent 2 }}
{{- else if eq .member "leader" }}
{{- $quoted := list }}
{{- range $args }}{{ $quoted = append $quoted (squote .) }}{{ end }}
command: ["/bin/sh", "-c"]
args:
  - |
    set -eu
    ray start --head --port={{ $r.multiNode.rayPort }} --disable-usage-stats
    deadline=$(( $(date +%s) + {{ int $r.multiNode.joinTimeoutSeconds }} ))
    until [ "$(python3 -c 'import ray; ray.init(address="auto", logging_level="ERROR"); print(sum(1 for n in ray.nodes() if n["Alive"]))')" -ge "${LWS_GROUP_SIZE}" ]; do
      if [ "$(date +%s)" -ge "$deadline" ]; then
        echo "pdserve: not every node of this group joined Ray within {{ int $r.multiNode.joinTimeoutSeconds }}s" >&2
        exit 1
      fi
      sleep 5
    done
    exec pdserve {{ join " " $quoted }} --engine-id "${POD_NAME}" --advertise "${POD_IP}{{ $advertise }}"
{{- else }}
command: ["/bin/sh", "-c"]
args:
  - exec ray start --address="${LWS_LEADER_ADDRESS}:{{ $r.multiNode.rayPort }}" --block --disable-usage-stats
{{- end }}
{{- end }}

{{/* metadata + spec of one engine pod. */}}
{{- define "pdserve.engine.podTemplate" -}}
{{- $root := .root }}
{{- $r := index $root.Values .role }}
{{- $serving := ne .member "worker" }}
{{- $drainBound := include "pdserve.engine.drainBound" . }}
metadata:
  labels:
    {{- include "pdserve.componentLabels" (dict "root" $root "component" (include "pdserve.engine.component" .)) | nindent 4 }}
    pdserve.io/member: {{ .member }}
    {{- if $serving }}
    pdserve.io/serving: "true"
    {{- end }}
    {{- with $r.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- with $r.podAnnotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  {{- include "pdserve.podPlacement" (dict "root" $root "placement" $r "serviceAccount" true) | trim | nindent 2 }}
  terminationGracePeriodSeconds: {{ include "pdserve.engine.gracePeriod" . }}
  containers:
    - name: {{ ternary "engine" "ray-worker" $serving }}
      image: {{ include "pdserve.image" $root }}
      imagePullPolicy: {{ $root.Values.image.pullPolicy }}
      {{- include "pdserve.engine.command" . | trim | nindent 6 }}
      env:
        - name: POD_IP
          valueFrom:
            fieldRef:
              fieldPath: status.podIP
        - name: POD_NAME
          valueFrom:
            fieldRef:
              fieldPath: metadata.name
        {{- include "pdserve.controlPlaneEnv" $root | trim | nindent 8 }}
        {{- with (include "pdserve.engine.ucxEnv" . | trim) }}
        {{- . | nindent 8 }}
        {{- end }}
        {{- with $r.extraEnv }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- if or $serving $r.multiNode.enabled }}
      ports:
        {{- if $serving }}
        - name: grpc
          containerPort: {{ $r.grpcPort }}
        - name: metrics
          containerPort: {{ $r.metricsPort }}
        {{- end }}
        {{- if $r.multiNode.enabled }}
        - name: ray
          containerPort: {{ $r.multiNode.rayPort }}
        {{- end }}
      {{- end }}
      resources:
        {{- include "pdserve.engine.resources" . | trim | nindent 8 }}
      {{- if $r.rdma.ipcLock }}
      securityContext:
        capabilities:
          add: ["IPC_LOCK"]
      {{- end }}
      {{- if $serving }}
      # Health is SERVING once the engine's PP x TP grid is READY in the control plane and
      # NOT_SERVING while loading or draining, so it gates startup and readiness. Liveness only
      # asks whether the server answers: a draining engine must not be restarted.
      startupProbe:
        grpc:
          port: {{ $r.grpcPort }}
        periodSeconds: {{ $r.probes.periodSeconds }}
        failureThreshold: {{ $r.probes.startupFailureThreshold }}
      readinessProbe:
        grpc:
          port: {{ $r.grpcPort }}
        periodSeconds: {{ $r.probes.periodSeconds }}
        failureThreshold: 3
      livenessProbe:
        tcpSocket:
          port: grpc
        periodSeconds: {{ $r.probes.periodSeconds }}
        failureThreshold: 6
      {{- if $r.drain.preStop }}
      # The service drains on SIGTERM (stops admitting, finishes in-flight work) and keeps the KV
      # it handed to decoders until they pulled it or its lease ran out. The hook starts that drain
      # and holds the pod until the service exits, at most drain + lease seconds; the grace
      # period is longer, so the kubelet's SIGKILL never cuts a transfer short.
      lifecycle:
        preStop:
          exec:
            command:
              - /bin/sh
              - -c
              - kill -TERM 1; i=0; while kill -0 1 2>/dev/null && [ "$i" -lt {{ $drainBound }} ]; do sleep 1; i=$((i+1)); done
      {{- end }}
      {{- end }}
      volumeMounts:
        - name: dshm
          mountPath: /dev/shm
        {{- with (include "pdserve.sharedVolumeMounts" $root | trim) }}
        {{- . | nindent 8 }}
        {{- end }}
  volumes:
    - name: dshm
      emptyDir:
        medium: Memory
        sizeLimit: {{ $r.shmSize }}
    {{- with (include "pdserve.sharedVolumes" $root | trim) }}
    {{- . | nindent 4 }}
    {{- end }}
{{- end }}

{{/*
Replicas of a role's workload: (dict "root" $ "role" ... "kind" "StatefulSet"|"LeaderWorkerSet").
With the planner on, its autoscaler owns them: an upgrade keeps the live count (looked up), and a
first install starts within the planner's bounds. Otherwise the role's `replicas`.
*/}}
{{- define "pdserve.engine.replicas" -}}
{{- $r := index .root.Values .role }}
{{- if include "pdserve.planner.scales" . }}
{{- $bounds := index .root.Values.planner .role }}
{{- $apiVersion := ternary "leaderworkerset.x-k8s.io/v1" "apps/v1" (eq .kind "LeaderWorkerSet") }}
{{- $name := printf "%s-%s" (include "pdserve.fullname" .root) .role }}
{{- $live := lookup $apiVersion .kind .root.Release.Namespace $name }}
{{- if and $live $live.spec (hasKey $live.spec "replicas") }}
{{- $live.spec.replicas }}
{{- else }}
{{- max (int $bounds.minReplicas) (min (int $r.replicas) (int $bounds.maxReplicas)) }}
{{- end }}
{{- else }}
{{- $r.replicas }}
{{- end }}
{{- end }}
