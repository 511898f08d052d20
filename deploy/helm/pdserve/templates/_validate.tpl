{{/* Rules only the KubeRay operator checks (the API server accepts these objects): fail at render time. */}}
{{- define "pdserve.validate" -}}
{{- $name := include "pdserve.fullname" . -}}
{{- if gt (len $name) 47 -}}
{{- fail (printf "RayService name %q is %d characters; KubeRay allows at most 47 (set fullnameOverride or a shorter release name)" $name (len $name)) -}}
{{- end -}}
{{- if not (regexMatch "^[a-z]([-a-z0-9]*[a-z0-9])?$" $name) -}}
{{- fail (printf "RayService name %q is not a DNS-1035 label (lowercase letters, digits and '-', starting with a letter)" $name) -}}
{{- end -}}
{{- $groups := include "pdserve.workerRoles" . | fromJsonArray -}}
{{- $seen := dict -}}
{{- range $role := $groups -}}
{{- $v := index $.Values $role -}}
{{- if hasKey $seen $v.groupName -}}
{{- fail (printf "worker groupName %q is used twice (prefill.groupName and decode.groupName must differ)" $v.groupName) -}}
{{- end -}}
{{- $_ := set $seen $v.groupName true -}}
{{- if or (gt (int $v.minReplicas) (int $v.replicas)) (gt (int $v.replicas) (int $v.maxReplicas)) -}}
{{- fail (printf "%s: need minReplicas <= replicas <= maxReplicas, got %d <= %d <= %d" $role (int $v.minReplicas) (int $v.replicas) (int $v.maxReplicas)) -}}
{{- end -}}
{{- if hasKey (default dict $v.rayStartParams) "labels" -}}
{{- fail (printf "%s.rayStartParams.labels is not allowed: pdserve sets the group's Ray labels itself" $role) -}}
{{- end -}}
{{- $ranks := include "pdserve.ranks" $v | int -}}
{{- $podGpus := index (default dict (default dict $v.resources).limits) "nvidia.com/gpu" | default 0 | float64 -}}
{{- $replicaGpus := mulf (float64 $v.numGpus) (float64 $ranks) -}}
{{- if gt $replicaGpus $podGpus -}}
{{- fail (printf "%s: a replica takes numGpus x worker.tensor_parallel_size = %g GPUs but the pod's resources.limits[nvidia.com/gpu] is %g: it would never be scheduled" $role $replicaGpus $podGpus) -}}
{{- end -}}
{{- if $v.rayResources -}}
{{- range $k := list "num-cpus" "num-gpus" "memory" "resources" -}}
{{- if hasKey (default dict $v.rayStartParams) $k -}}
{{- fail (printf "%s.rayStartParams.%s cannot be set together with %s.rayResources (the group's top-level resources)" $role $k $role) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if hasKey (default dict .Values.head.rayStartParams) "labels" -}}
{{- fail "head.rayStartParams.labels is not allowed" -}}
{{- end -}}
{{- if and (eq .Values.system.transport "redis") (not (include "pdserve.redisUrl" .)) -}}
{{- fail "system.transport redis needs redis.enabled or redis.external.url" -}}
{{- end -}}
{{- if and (ne .Values.model.source "image") (not (or .Values.model.pvc.claimName .Values.model.hostPath.path)) -}}
{{- fail (printf "model.source %s needs model.pvc.claimName or model.hostPath.path" .Values.model.source) -}}
{{- end -}}
{{- end -}}

{{- define "pdserve.workerRoles" -}}
{{- if eq .Values.system.mode "disaggregated" -}}["prefill","decode"]{{- else -}}["decode"]{{- end -}}
{{- end -}}
