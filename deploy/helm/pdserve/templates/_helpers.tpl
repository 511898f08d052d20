{{- define "pdserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The RayService name: KubeRay wants DNS-1035 and at most 47 characters (checked in _validate.tpl). */}}
{{- define "pdserve.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride -}}
{{- else if contains (include "pdserve.name" .) .Release.Name -}}
{{- .Release.Name -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name (include "pdserve.name" .) -}}
{{- end -}}
{{- end -}}

{{- define "pdserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pdserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "pdserve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "pdserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "pdserve.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* The Ray node label that pins a role's Serve replicas to its worker group. */}}
{{- define "pdserve.roleLabelKey" -}}pdserve.io/role{{- end -}}

{{- define "pdserve.redisSecretName" -}}
{{- if .Values.redis.enabled -}}
{{- default (printf "%s-redis" (include "pdserve.fullname" .)) .Values.redis.auth.existingSecret -}}
{{- else -}}
{{- .Values.redis.external.existingSecret -}}
{{- end -}}
{{- end -}}

{{- define "pdserve.redisSecretKey" -}}
{{- if .Values.redis.enabled -}}{{ .Values.redis.auth.existingSecretKey }}{{- else -}}{{ .Values.redis.external.existingSecretKey }}{{- end -}}
{{- end -}}

{{/* The Redis URL in SystemConfig; ${PDSERVE_REDIS_PASSWORD} is filled in by the Serve app builder from the Secret. */}}
{{- define "pdserve.redisUrl" -}}
{{- if .Values.redis.enabled -}}
{{- printf "redis://:${PDSERVE_REDIS_PASSWORD}@%s-redis:6379/0" (include "pdserve.fullname" .) -}}
{{- else -}}
{{- .Values.redis.external.url -}}
{{- end -}}
{{- end -}}

{{- define "pdserve.modelPath" -}}
{{- $m := .Values.model -}}
{{- $base := $m.path -}}
{{- if ne $m.source "image" -}}
{{- $base = trimSuffix "/" (printf "%s/%s" $m.mountPath (trimPrefix "/" $m.path)) -}}
{{- end -}}
{{- if $m.file -}}{{ printf "%s/%s" $base $m.file }}{{- else -}}{{ $base }}{{- end -}}
{{- end -}}

{{/* Env shared by every pod: the pod IP the UCX listener advertises, Serve's settings, MALLOC_ARENA_MAX, OTEL_*, the API key file, the Redis password, extraEnv. */}}
{{- define "pdserve.commonEnv" -}}
- name: PDSERVE_UCX_HOST
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
{{- range $k, $v := .Values.serve.env }}
- name: {{ $k }}
  value: {{ $v | quote }}
{{- end }}
{{- if .Values.serve.mallocArenaMax }}
- name: MALLOC_ARENA_MAX
  value: {{ .Values.serve.mallocArenaMax | quote }}
{{- end }}
{{- range $k, $v := .Values.otel.env }}
- name: {{ $k }}
  value: {{ $v | quote }}
{{- end }}
{{- if .Values.apiKeys.existingSecret }}
- name: PDSERVE_API_KEYS_FILE
  value: /etc/pdserve/api-keys/{{ .Values.apiKeys.key }}
{{- end }}
{{- if include "pdserve.redisSecretName" . }}
- name: PDSERVE_REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "pdserve.redisSecretName" . }}
      key: {{ include "pdserve.redisSecretKey" . }}
{{- end }}
{{- with .Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Pod template for the head (role "head") or a worker group (role "prefill" / "decode"). */}}
{{- define "pdserve.podTemplate" -}}
{{- $ := .root -}}
{{- $role := .role -}}
{{- $v := .values -}}
metadata:
  labels:
    {{- include "pdserve.labels" $ | nindent 4 }}
    app.kubernetes.io/component: {{ $role }}
spec:
  {{- with $.Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  securityContext:
    {{- toYaml $.Values.podSecurityContext | nindent 4 }}
  {{- with $v.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $v.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $v.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  containers:
    - name: ray-{{ $role }}
      image: {{ include "pdserve.image" $ }}
      imagePullPolicy: {{ $.Values.image.pullPolicy }}
      securityContext:
        {{- toYaml $.Values.securityContext | nindent 8 }}
      {{- $env := include "pdserve.commonEnv" $ | trim }}
      {{- if or $env $v.env }}
      env:
        {{- with $env }}
        {{- . | nindent 8 }}
        {{- end }}
        {{- with $v.env }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- end }}
      ports:
        {{- if eq $role "head" }}
        - {name: gcs, containerPort: 6379}
        - {name: dashboard, containerPort: 8265}
        - {name: client, containerPort: 10001}
        {{- end }}
        - {name: serve, containerPort: {{ $.Values.serve.httpPort }}}
        {{- if $.Values.serve.grpcPort }}
        - {name: grpc, containerPort: {{ $.Values.serve.grpcPort }}}
        {{- end }}
      resources:
        {{- toYaml $v.resources | nindent 8 }}
      {{- if ne $role "head" }}
      startupProbe:
        httpGet: {path: /health, port: serve}
        periodSeconds: {{ $v.startupProbe.periodSeconds }}
        failureThreshold: {{ $v.startupProbe.failureThreshold }}
      readinessProbe:
        httpGet: {path: /health, port: serve}
        periodSeconds: {{ $v.readinessProbe.periodSeconds }}
        failureThreshold: {{ $v.readinessProbe.failureThreshold }}
      {{- end }}
      volumeMounts:
        - {name: dshm, mountPath: /dev/shm}
        {{- if ne $.Values.model.source "image" }}
        - {name: model, mountPath: {{ $.Values.model.mountPath }}, readOnly: true}
        {{- end }}
        {{- if $.Values.apiKeys.existingSecret }}
        - {name: api-keys, mountPath: /etc/pdserve/api-keys, readOnly: true}
        {{- end }}
        {{- with $v.volumeMounts }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
  volumes:
    - name: dshm
      emptyDir: {medium: Memory}
    {{- if eq $.Values.model.source "pvc" }}
    - name: model
      persistentVolumeClaim: {claimName: {{ $.Values.model.pvc.claimName }}, readOnly: true}
    {{- else if eq $.Values.model.source "hostPath" }}
    - name: model
      hostPath: {path: {{ $.Values.model.hostPath.path }}, type: {{ $.Values.model.hostPath.type }}}
    {{- end }}
    {{- if $.Values.apiKeys.existingSecret }}
    - name: api-keys
      secret: {secretName: {{ $.Values.apiKeys.existingSecret }}}
    {{- end }}
    {{- with $v.volumes }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
{{- end -}}
