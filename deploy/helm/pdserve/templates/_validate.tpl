{{/*
pdserve.validate: the cross-field rules values.schema.json cannot express. Collects every problem
and fails rendering once, listing them all (bitnami's validateValues pattern). Rendered by
templates/validate.yaml, so `helm install`, `helm template` and `helm lint` all run it.
*/}}
{{- define "pdserve.validate" -}}
{{- $errors := list }}
{{- $v := .Values }}

{{- if not $v.decode.enabled }}
{{- $errors = append $errors "decode.enabled=false: the router needs decode engines (prefill alone cannot serve)" }}
{{- end }}

{{- range $role := list "prefill" "decode" }}
{{- $r := index $v $role }}
{{- if $r.enabled }}
{{- $world := mul (int $r.pp) (int $r.tp) }}
{{- if $r.multiNode.enabled }}
{{- if not $v.leaderWorkerSet.enabled }}
{{- $errors = append $errors (printf "%s.multiNode.enabled=true needs leaderWorkerSet.enabled=true: one engine spanning nodes is a LeaderWorkerSet group (install the LWS controller, https://lws.sigs.k8s.io); a StatefulSet pod cannot span nodes" $role) }}
{{- end }}
{{- if ne $r.engine "vllm" }}
{{- $errors = append $errors (printf "%s.multiNode.enabled=true needs %s.engine=vllm: the %s engine runs on one node" $role $role $r.engine) }}
{{- else if ne (mod $world (int $r.multiNode.nodes)) 0 }}
{{- $errors = append $errors (printf "%s: pp * tp = %d GPUs cannot be split evenly over multiNode.nodes=%d" $role $world (int $r.multiNode.nodes)) }}
{{- end }}
{{- end }}
{{- if and (include "pdserve.lora.enabled" $) (ne $r.engine "vllm") }}
{{- $errors = append $errors (printf "lora.enabled=true (or lora.modules) needs %s.engine=vllm: the %s engine serves no LoRA adapter" $role $r.engine) }}
{{- end }}
{{- $startupWindow := mul (int $r.probes.startupFailureThreshold) (int $r.probes.periodSeconds) }}
{{- if gt (int $r.readyTimeoutSeconds) $startupWindow }}
{{- $errors = append $errors (printf "%s.readyTimeoutSeconds=%d exceeds the startup probe's window probes.startupFailureThreshold x probes.periodSeconds = %ds: the kubelet would restart the pod before the engine gives up" $role (int $r.readyTimeoutSeconds) $startupWindow) }}
{{- end }}
{{- $floor := int (include "pdserve.engine.drainBound" (dict "root" $ "role" $role)) }}
{{- if and (not (kindIs "invalid" $r.terminationGracePeriodSeconds)) (le (int $r.terminationGracePeriodSeconds) $floor) }}
{{- $errors = append $errors (printf "%s.terminationGracePeriodSeconds=%d must exceed drain.timeoutSeconds + kvLeaseSeconds = %d, or the kubelet kills the drain before KV leases run out" $role (int $r.terminationGracePeriodSeconds) $floor) }}
{{- end }}
{{- end }}
{{- end }}

{{- if eq $v.redis.mode "external" }}
{{- if not $v.redis.external.url }}
{{- $errors = append $errors "redis.mode=external needs redis.external.url (redis://host:6379/0 or rediss://...)" }}
{{- else if not (regexMatch "^(redis|rediss|unix|redis\\+sentinel)://" $v.redis.external.url) }}
{{- $errors = append $errors (printf "redis.external.url=%q must start with redis://, rediss://, unix:// or redis+sentinel://" $v.redis.external.url) }}
{{- end }}
{{- if not $v.redis.external.existingSecret }}
{{- $errors = append $errors "redis.mode=external needs redis.external.existingSecret: the Secret holding the Redis password (the control plane is a trust boundary; no password-less Redis)" }}
{{- end }}
{{- end }}

{{- if gt (mul 2 (int $v.controlPlane.heartbeatIntervalSeconds)) (int $v.controlPlane.leaseTtlSeconds) }}
{{- $errors = append $errors (printf "controlPlane.heartbeatIntervalSeconds=%v must be at most half of controlPlane.leaseTtlSeconds=%v, so one lost heartbeat does not expire an engine" $v.controlPlane.heartbeatIntervalSeconds $v.controlPlane.leaseTtlSeconds) }}
{{- end }}

{{- if and $v.metrics.podMonitor.enabled $v.metrics.serviceMonitor.enabled }}
{{- $errors = append $errors "metrics.podMonitor.enabled and metrics.serviceMonitor.enabled are both true: every target would be scraped twice and dashboards would double-count; enable one" }}
{{- end }}

{{- if $v.router.autoscaling.enabled }}
{{- if gt (int $v.router.autoscaling.minReplicas) (int $v.router.autoscaling.maxReplicas) }}
{{- $errors = append $errors (printf "router.autoscaling.minReplicas=%d is above maxReplicas=%d" (int $v.router.autoscaling.minReplicas) (int $v.router.autoscaling.maxReplicas)) }}
{{- end }}
{{- end }}
{{- if $v.router.podDisruptionBudget.enabled }}
{{- $floorReplicas := ternary (int $v.router.autoscaling.minReplicas) (int $v.router.replicas) $v.router.autoscaling.enabled }}
{{- if ge (int $v.router.podDisruptionBudget.minAvailable) $floorReplicas }}
{{- $errors = append $errors (printf "router.podDisruptionBudget.minAvailable=%d must be below the router's replicas (%d), or no node can ever be drained" (int $v.router.podDisruptionBudget.minAvailable) $floorReplicas) }}
{{- end }}
{{- end }}

{{- if $v.planner.enabled }}
{{- $p := $v.planner }}
{{- range $pool := list "prefill" "decode" }}
{{- $b := index $p $pool }}
{{- if gt (int $b.minReplicas) (int $b.maxReplicas) }}
{{- $errors = append $errors (printf "planner.%s.minReplicas=%d is above maxReplicas=%d" $pool (int $b.minReplicas) (int $b.maxReplicas)) }}
{{- end }}
{{- end }}
{{- if and (eq $p.autoscaling.mode "keda") (not $p.autoscaling.keda.serverAddress) }}
{{- $errors = append $errors "planner.autoscaling.mode=keda needs planner.autoscaling.keda.serverAddress: the Prometheus that scrapes the planner (e.g. http://prometheus-operated.monitoring.svc:9090)" }}
{{- end }}
{{- if $p.profileJson }}
{{- $profile := $p.profileJson | fromJson }}
{{- if or (hasKey $profile "Error") (not (hasKey $profile "format_version")) }}
{{- $errors = append $errors "planner.profileJson is not a profile: expected the JSON of a profile file (with format_version), as `pdserve profile` writes it" }}
{{- end }}
{{- end }}
{{- end }}

{{- if $v.models }}
{{- if $v.planner.enabled }}
{{- $errors = append $errors "models and planner.enabled=true: the planner sizes one model's pools; serve several models without it" }}
{{- end }}
{{- $folders := list (base $v.model.path) }}
{{- $names := list }}
{{- range $m := $v.models }}
{{- if has $m.name $names }}
{{- $errors = append $errors (printf "models: two entries are named %s" $m.name) }}
{{- end }}
{{- $names = append $names $m.name }}
{{- if has (base $m.path) $folders }}
{{- $errors = append $errors (printf "models[%s].path=%s: another model's folder has the name %s, and engines register a model by its folder's name" $m.name $m.path (base $m.path)) }}
{{- end }}
{{- $folders = append $folders (base $m.path) }}
{{- range $role := list "prefill" "decode" }}
{{- range $key, $_ := (default dict (index $m $role)) }}
{{- if not (hasKey (index $v $role) $key) }}
{{- $errors = append $errors (printf "models[%s].%s.%s is not a key of %s" $m.name $role $key $role) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{- if $errors }}
{{- fail (printf "\n\npdserve: invalid values:\n  - %s\n" (join "\n  - " $errors)) }}
{{- end }}
{{- end }}
