{{/* SystemConfig (pdserve.services.app) as a dict: the `args` of every pdserve Serve application. */}}
{{- define "pdserve.systemConfig" -}}
{{- $key := include "pdserve.roleLabelKey" . -}}
{{- $cfg := dict "mode" .Values.system.mode "model" (include "pdserve.modelPath" .) "transport" .Values.system.transport -}}
{{- $redisUrl := include "pdserve.redisUrl" . -}}
{{- if $redisUrl }}{{- $_ := set $cfg "redis_url" $redisUrl -}}{{- end -}}
{{- range $role := list "prefill" "decode" -}}
{{- $v := index $.Values $role -}}
{{- $fixed := dict "num_replicas" (int $v.serveReplicas) "label_selector" (dict $key $role) -}}
{{- if and $v.autoscaling.enabled (eq (default "ongoing" $v.autoscaling.policy) "slo") -}}
{{- $bounds := dict "policy" "slo" "min_replicas" (int $v.autoscaling.minReplicas) "max_replicas" (int $v.autoscaling.maxReplicas) -}}
{{- $_ := set $fixed "autoscaling" (merge $bounds (deepCopy (default dict $v.autoscaling.slo))) -}}
{{- end -}}
{{- $_ := set $cfg $role (merge $fixed (deepCopy (default dict $v.worker))) -}}
{{- end -}}
{{- $router := dict "num_replicas" (int .Values.router.numReplicas) "num_cpus" .Values.router.numCpus -}}
{{- with .Values.model.servedName }}{{- $_ := set $router "served_model_name" . -}}{{- end -}}
{{- $_ := set $cfg "router" (merge $router (deepCopy (default dict .Values.router.config))) -}}
{{- $kv := deepCopy (default dict .Values.redis.kvstore) -}}
{{- if .Values.redis.enabled }}{{- $_ := set $kv "maxmemory_policy" .Values.redis.maxmemoryPolicy -}}{{- end -}}
{{- $_ := set $cfg "kvstore" $kv -}}
{{- $_ := set $cfg "tracing_env" (default dict .Values.otel.env) -}}
{{- toJson $cfg -}}
{{- end -}}

{{/* Serve autoscaling_config from a role's `autoscaling` values. */}}
{{- define "pdserve.autoscalingConfig" -}}
{{- toJson (dict "min_replicas" (int .minReplicas) "max_replicas" (int .maxReplicas) "target_ongoing_requests" .targetOngoingRequests) -}}
{{- end -}}

{{/* Per-deployment overrides of the pdserve application (autoscaling, GPUs). */}}
{{- define "pdserve.deploymentOverrides" -}}
{{- $key := include "pdserve.roleLabelKey" . -}}
{{- $out := list -}}
{{- if .Values.router.autoscaling.enabled -}}
{{- $out = append $out (dict "name" "router" "num_replicas" "auto" "autoscaling_config" (include "pdserve.autoscalingConfig" .Values.router.autoscaling | fromJson)) -}}
{{- end -}}
{{- $roles := list "decode" -}}
{{- if eq .Values.system.mode "disaggregated" }}{{- $roles = list "prefill" "decode" -}}{{- end -}}
{{- range $role := $roles -}}
{{- $v := index $.Values $role -}}
{{- $d := dict -}}
{{- /* policy slo: the deployment's autoscaling_config comes from the role's SystemConfig (build_pdserve) */ -}}
{{- if and $v.autoscaling.enabled (ne (default "ongoing" $v.autoscaling.policy) "slo") -}}
{{- $_ := set $d "num_replicas" "auto" -}}
{{- $_ := set $d "autoscaling_config" (include "pdserve.autoscalingConfig" $v.autoscaling | fromJson) -}}
{{- end -}}
{{- if gt (float64 $v.numGpus) 0.0 -}}
{{- /* per rank: a replica of tensor_parallel_size ranks takes that many CPU shares and GPUs (WorkerConfig.actor_options) */ -}}
{{- $ranks := include "pdserve.ranks" $v | float64 -}}
{{- $cpus := default 1 (index (default dict $v.worker) "num_cpus") | float64 -}}
{{- $_ := set $d "ray_actor_options" (dict "num_cpus" (mulf $cpus $ranks) "num_gpus" (mulf $v.numGpus $ranks) "label_selector" (dict $key $role)) -}}
{{- end -}}
{{- if $d -}}
{{- $_ := set $d "name" $role -}}
{{- $out = append $out $d -}}
{{- end -}}
{{- end -}}
{{- toJson $out -}}
{{- end -}}

{{- define "pdserve.serveConfig" -}}
{{- $args := include "pdserve.systemConfig" . | fromJson -}}
{{- $apps := list -}}
{{- if include "pdserve.redisUrl" . -}}
{{- $apps = append $apps (dict "name" "kvstore" "import_path" "pdserve.services.serve_builder:build_kvstore" "route_prefix" nil "args" $args) -}}
{{- end -}}
{{- $app := dict "name" "pdserve" "import_path" "pdserve.services.serve_builder:build_pdserve" "route_prefix" "/" "args" $args -}}
{{- $deployments := include "pdserve.deploymentOverrides" . | fromJsonArray -}}
{{- if $deployments }}{{- $_ := set $app "deployments" $deployments -}}{{- end -}}
{{- $apps = append $apps $app -}}
{{- $cfg := dict "http_options" (dict "host" "0.0.0.0" "port" (int .Values.serve.httpPort)) "applications" $apps -}}
{{- if .Values.serve.grpcPort -}}
{{- $_ := set $cfg "grpc_options" (dict "port" (int .Values.serve.grpcPort) "grpc_servicer_functions" (list "pdserve.v1.generate_pb2_grpc.add_GenerateServiceServicer_to_server")) -}}
{{- end -}}
{{- toYaml $cfg -}}
{{- end -}}

{{/* A role's tensor_parallel_size (ranks per replica), from its worker values. */}}
{{- define "pdserve.ranks" -}}
{{- int (default 1 (index (default dict .worker) "tensor_parallel_size")) -}}
{{- end -}}
