{{/* ---------- names and labels ---------- */}}

{{- define "mpc.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Resource name prefix; kept short so "<prefix>-<deployment>-mooncake" fits 63 chars. */}}
{{- define "mpc.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 30 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 30 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 30 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "mpc.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Selector labels. Call with (dict "root" $ "component" "master"). */}}
{{- define "mpc.selectorLabels" -}}
app.kubernetes.io/name: {{ include "mpc.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- with .deployment }}
mooncake-pooled-connector/deployment: {{ . }}
{{- end }}
{{- end }}

{{/* All labels. Same argument as mpc.selectorLabels. */}}
{{- define "mpc.labels" -}}
{{ include "mpc.selectorLabels" . }}
helm.sh/chart: {{ include "mpc.chart" .root }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: {{ include "mpc.name" .root }}
{{- with .root.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "mpc.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "mpc.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Image reference. Call with (dict "image" <override map or nil> "root" $). */}}
{{- define "mpc.image" -}}
{{- $base := .root.Values.image }}
{{- $o := .image | default dict }}
{{- printf "%s:%s" (default $base.repository $o.repository) (default $base.tag $o.tag | toString) }}
{{- end }}

{{- define "mpc.pullPolicy" -}}
{{- $o := .image | default dict }}
{{- default .root.Values.image.pullPolicy $o.pullPolicy }}
{{- end }}

{{/* ---------- Mooncake master endpoints ---------- */}}

{{- define "mpc.master.deployed" -}}
{{- if not .Values.master.external.address }}true{{ end }}
{{- end }}

{{- define "mpc.master.serviceName" -}}
{{- printf "%s-master" (include "mpc.fullname" .) }}
{{- end }}

{{- define "mpc.master.host" -}}
{{- printf "%s.%s.svc" (include "mpc.master.serviceName" .) .Release.Namespace }}
{{- end }}

{{/* Masters deployed by the chart in HA mode (leader election through etcd). */}}
{{- define "mpc.master.ha" -}}
{{- if and (include "mpc.master.deployed" .) .Values.master.ha.enabled }}true{{ end }}
{{- end }}

{{/* The chart deploys the single-member etcd (HA without master.ha.etcd.endpoints). */}}
{{- define "mpc.etcd.bundled" -}}
{{- if and (include "mpc.master.ha" .) (not .Values.master.ha.etcd.endpoints) }}true{{ end }}
{{- end }}

{{- define "mpc.etcd.name" -}}
{{- printf "%s-etcd" (include "mpc.fullname" .) }}
{{- end }}

{{/* etcd endpoints as mooncake_master --etcd_endpoints takes them: host:port;host:port. */}}
{{- define "mpc.etcd.endpoints" -}}
{{- if .Values.master.ha.etcd.endpoints }}
{{- join ";" .Values.master.ha.etcd.endpoints }}
{{- else }}
{{- printf "%s.%s.svc:%d" (include "mpc.etcd.name" .) .Release.Namespace (int .Values.master.ha.etcd.bundled.clientPort) }}
{{- end }}
{{- end }}

{{/* The master RPC endpoint clients use: host:port, or etcd://<endpoints> for HA masters. */}}
{{- define "mpc.master.address" -}}
{{- if .Values.master.external.address }}
{{- .Values.master.external.address }}
{{- else if include "mpc.master.ha" . }}
{{- printf "etcd://%s" (include "mpc.etcd.endpoints" .) }}
{{- else }}
{{- printf "%s:%d" (include "mpc.master.host" .) (int .Values.master.ports.rpc) }}
{{- end }}
{{- end }}

{{/* The metadata server clients use: the master's HTTP one, or etcd for HA masters. */}}
{{- define "mpc.master.metadataServer" -}}
{{- if .Values.master.external.address }}
{{- $host := regexReplaceAll ":[0-9]+$" .Values.master.external.address "" }}
{{- default (printf "http://%s:8080/metadata" $host) .Values.master.external.metadataServer }}
{{- else if include "mpc.master.ha" . }}
{{- printf "etcd://%s" (include "mpc.etcd.endpoints" .) }}
{{- else }}
{{- printf "http://%s:%d/metadata" (include "mpc.master.host" .) (int .Values.master.ports.metadata) }}
{{- end }}
{{- end }}

{{/* Env every Mooncake client (engine, store node) gets: the transfer engine's port range
and, with HA masters, the cluster id they find the leader under. */}}
{{- define "mpc.mooncakeEnv" -}}
{{- $t := .Values.transferEngine }}
{{- if gt (int $t.minPort) (int $t.maxPort) }}
{{- fail (printf "transferEngine: minPort %d is above maxPort %d" (int $t.minPort) (int $t.maxPort)) }}
{{- end }}
- name: MC_MIN_RPC_PORT
  value: {{ int $t.minPort | quote }}
- name: MC_MAX_RPC_PORT
  value: {{ int $t.maxPort | quote }}
{{- if include "mpc.master.ha" . }}
- name: MC_STORE_CLUSTER_ID
  value: {{ .Values.master.ha.clusterId | quote }}
{{- end }}
{{- end }}

{{/* ---------- shared pod pieces ---------- */}}

{{- define "mpc.podSecurityContext" -}}
{{- $s := .Values.security -}}
runAsNonRoot: {{ $s.runAsNonRoot }}
{{- if not (kindIs "invalid" $s.runAsUser) }}
runAsUser: {{ int $s.runAsUser }}
{{- end }}
{{- if not (kindIs "invalid" $s.runAsGroup) }}
runAsGroup: {{ int $s.runAsGroup }}
{{- end }}
{{- if not (kindIs "invalid" $s.fsGroup) }}
fsGroup: {{ int $s.fsGroup }}
{{- end }}
{{- with $s.seccompProfile }}
seccompProfile:
  type: {{ . }}
{{- end }}
{{- end }}

{{/* Container securityContext. Call with (dict "root" $ "protocol" "tcp|rdma" "readOnlyRoot" bool). */}}
{{- define "mpc.containerSecurityContext" -}}
allowPrivilegeEscalation: false
privileged: false
readOnlyRootFilesystem: {{ .readOnlyRoot | default false }}
capabilities:
  drop:
    - ALL
  {{- if and (eq .protocol "rdma") .root.Values.security.rdmaCapabilities }}
  add:
    {{- toYaml .root.Values.security.rdmaCapabilities | nindent 4 }}
  {{- end }}
{{- end }}

{{/* Container resources, plus security.rdmaResources for rdma. Call with (dict "root" $ "resources" map "protocol" p). */}}
{{- define "mpc.resources" -}}
{{- $r := deepCopy (.resources | default dict) }}
{{- if and (eq .protocol "rdma") .root.Values.security.rdmaResources }}
{{- $limits := deepCopy ($r.limits | default dict) }}
{{- $requests := deepCopy ($r.requests | default dict) }}
{{- range $k, $v := .root.Values.security.rdmaResources }}
{{- $_ := set $limits $k $v }}
{{- $_ := set $requests $k $v }}
{{- end }}
{{- $_ := set $r "limits" $limits }}
{{- $_ := set $r "requests" $requests }}
{{- end }}
{{- if $r }}
{{- toYaml $r }}
{{- else -}}
{}
{{- end }}
{{- end }}

{{/* Credentials, only from Secrets. The Hugging Face token is a file (HF_TOKEN_PATH, read by
huggingface_hub), so it is not in the process environment; vLLM reads its API key only from
VLLM_API_KEY (or the command line), so that one stays an env var from a secretKeyRef. */}}
{{- define "mpc.secretEnv" -}}
{{- if .Values.secrets.hfToken.name }}
- name: HF_TOKEN_PATH
  value: /etc/hf-token/token
{{- end }}
{{- with .Values.secrets.apiKey }}
{{- if .name }}
- name: VLLM_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ .name }}
      key: {{ .key }}
{{- end }}
{{- end }}
{{- end }}

{{/* Fail on extraEnv entries that put a credential-looking name into a plain value. */}}
{{- define "mpc.checkEnv" -}}
{{- range .env }}
{{- if and (hasKey . "value") (regexMatch "(?i)(TOKEN|API_?KEY|SECRET|PASSWORD)" .name) }}
{{- fail (printf "%s: env %s must come from a Secret (valueFrom.secretKeyRef), not a plain value" $.where .name) }}
{{- end }}
{{- end }}
{{- end }}

{{/* ---------- vLLM deployments ---------- */}}

{{/*
Merge one `deployments` entry over deploymentDefaults into .out (a dict).
Map values are merged one level deep; scalars (including 0, false and "") and lists replace.
Call with (dict "out" $d "defaults" .Values.deploymentDefaults "entry" $entry "root" $).
*/}}
{{- define "mpc.mergeDeployment" -}}
{{- $out := .out }}
{{- range $k, $v := .defaults }}
{{- if kindIs "invalid" $v }}
{{- $_ := set $out $k $v }}
{{- else }}
{{- $_ := set $out $k (deepCopy $v) }}
{{- end }}
{{- end }}
{{- range $k, $v := .entry }}
{{- if and (kindIs "map" $v) (kindIs "map" (get $out $k)) }}
{{- $m := get $out $k }}
{{- range $k2, $v2 := $v }}
{{- $_ := set $m $k2 $v2 }}
{{- end }}
{{- else }}
{{- $_ := set $out $k $v }}
{{- end }}
{{- end }}
{{- if kindIs "invalid" $out.globalSegmentSize }}
{{- $_ := set $out "globalSegmentSize" (ternary 0 "4GB" .root.Values.storeNodes.enabled) }}
{{- end }}
{{- $where := printf "deployments[%s]" $out.name }}
{{- if not $out.model }}
{{- fail (printf "%s: model is required" $where) }}
{{- end }}
{{- include "mpc.checkEnv" (dict "env" $out.extraEnv "where" $where) }}
{{- /* The connector refuses this pair at startup; the schema cannot see it once a default's
extraConfig meets an entry's recvThreads. */}}
{{- $ec := $out.extraConfig | default dict }}
{{- if and (hasKey $ec "load_threads_max") (not (kindIs "invalid" (index $ec "load_threads_max"))) (ne (toString $out.recvThreads) "auto") }}
{{- fail (printf "%s: extraConfig.load_threads_max is used only with recvThreads: auto, not %v; set recvThreads to auto or remove load_threads_max" $where $out.recvThreads) }}
{{- end }}
{{- $mt := .root.Values.master.multiTenants }}
{{- if and $mt.enabled (not $mt.tenants) }}
{{- fail "master.multiTenants.enabled: list the tenants and their quotas in master.multiTenants.tenants" }}
{{- end }}
{{- if and $out.kvEvents.enabled (gt (float64 $out.kvEvents.sweepSeconds) 0.0) (ne $out.tenantId "default") }}
{{- fail (printf "%s: kvEvents.sweepSeconds: the master's HTTP key query sees only the default tenant, not tenantId %q; set kvEvents.sweepSeconds to 0 (removals then come from lookups only)" $where $out.tenantId) }}
{{- end }}
{{- if and $mt.enabled (not (has $out.tenantId (include "mpc.tenantNames" .root | fromJsonArray))) }}
{{- fail (printf "%s: tenantId %q is not in master.multiTenants.tenants; its writes would be refused (-1701)" $where $out.tenantId) }}
{{- end }}
{{- end }}

{{/* Tenant names of master.multiTenants.tenants, as a JSON list. */}}
{{- define "mpc.tenantNames" -}}
{{- $names := list }}
{{- range .Values.master.multiTenants.tenants }}
{{- $names = append $names .name }}
{{- end }}
{{- toJson $names }}
{{- end }}

{{/* The pool has a disk tier (store nodes with storeNodes.offload). */}}
{{- define "mpc.offload" -}}
{{- if and .Values.storeNodes.enabled .Values.storeNodes.offload.enabled }}true{{ end }}
{{- end }}

{{/* The master's tenant quota policy file (Mooncake's schema version 1). */}}
{{- define "mpc.tenantQuotas" -}}
version: 1
tenants:
{{- range .Values.master.multiTenants.tenants }}
  - name: {{ .name | quote }}
    quota: {{ .quota }}
{{- end }}
{{- end }}

{{/* Resource name of one vLLM deployment. Call with (dict "root" $ "d" $merged). */}}
{{- define "mpc.vllm.name" -}}
{{- printf "%s-%s" (include "mpc.fullname" .root) .d.name | trunc 54 | trimSuffix "-" }}
{{- end }}

{{/* Size value as rendered into JSON: integers stay numbers, strings stay strings. */}}
{{- define "mpc.size" -}}
{{- if kindIs "string" . }}{{ toJson . }}{{ else }}{{ int64 . }}{{ end }}
{{- end }}

{{/* A size as a flag value: a number as a plain integer (not 6.7108864e+07). */}}
{{- define "mpc.sizeArg" -}}
{{- if kindIs "string" . }}{{ . }}{{ else }}{{ int64 . }}{{ end }}
{{- end }}

{{/* The MOONCAKE_CONFIG_PATH file for one deployment. Call with (dict "root" $ "d" $merged). */}}
{{- define "mpc.vllm.mooncakeConfig" -}}
{
  "metadata_server": {{ include "mpc.master.metadataServer" .root | toJson }},
  "master_server_address": {{ include "mpc.master.address" .root | toJson }},
  "protocol": {{ .d.protocol | toJson }},
  {{- if eq .d.protocol "rdma" }}
  "device_name": {{ .d.deviceName | toJson }},
  {{- end }}
  "global_segment_size": {{ include "mpc.size" .d.globalSegmentSize }},
  "local_buffer_size": {{ include "mpc.size" .d.localBufferSize }},
  "tenant_id": {{ .d.tenantId | toJson }},
  "enable_offload": {{ if include "mpc.offload" .root }}true{{ else }}false{{ end }}
}
{{- end }}

{{/* The connector's environment in one deployment's engine container, and in its helm test
preflight container (so the preflight checks what the engine will use). Call with
(dict "root" $ "d" $merged). */}}
{{- define "mpc.vllm.connectorEnv" -}}
- name: VLLM_MOONCAKE_LOAD_RECV_THREADS
  value: {{ (eq (toString .d.recvThreads) "auto" | ternary "auto" (int .d.recvThreads)) | quote }}
- name: MOONCAKE_CONFIG_PATH
  value: /etc/mooncake/mooncake.json
- name: MOONCAKE_LOCAL_HOSTNAME
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
{{ include "mpc.mooncakeEnv" .root | trim }}
{{- end }}

{{/* The --kv-transfer-config JSON for one deployment. */}}
{{- define "mpc.vllm.kvTransferConfig" -}}
{{- $cfg := dict
  "kv_connector" "PooledMooncakeStoreConnector"
  "kv_connector_module_path" "connector"
  "kv_role" "kv_both"
  "kv_load_failure_policy" "recompute"
}}
{{- $extra := deepCopy (.d.extraConfig | default dict) }}
{{- with .d.kvEvents }}{{ if .enabled }}
{{- $_ := set $extra "kv_events" "on" }}
{{- $_ := set $extra "kv_events_sweep_s" .sweepSeconds }}
{{- /* The master Service's admin port, unless extraConfig names one. With HA masters only
the port: the connector asks the leader etcd names (their Service holds the standby too,
which answers the sweep's query with 503). */}}
{{- if and (gt (float64 .sweepSeconds) 0.0) (not (hasKey $extra "kv_events_master_http")) }}
{{- if include "mpc.master.ha" $.root }}
{{- $_ := set $extra "kv_events_master_http" (printf ":%d" (int $.root.Values.master.ports.metrics)) }}
{{- else }}
{{- $_ := set $extra "kv_events_master_http" (include "mpc.master.adminAddress" $.root) }}
{{- end }}
{{- end }}
{{- end }}{{ end }}
{{- with $extra }}
{{- $_ := set $cfg "kv_connector_extra_config" . }}
{{- end }}
{{- toJson $cfg }}
{{- end }}

{{/* The master's HTTP admin (metrics) port as host:port: the KV events sweep asks it which
announced blocks are still stored (docs/kv-events.md). */}}
{{- define "mpc.master.adminAddress" -}}
{{- if .Values.master.external.address }}
{{- printf "%s:%d" (regexReplaceAll ":[0-9]+$" .Values.master.external.address "") (int .Values.master.ports.metrics) }}
{{- else }}
{{- printf "%s:%d" (include "mpc.master.host" .) (int .Values.master.ports.metrics) }}
{{- end }}
{{- end }}

{{/* vLLM's --kv-events-config for one deployment with kvEvents.enabled: the ZMQ publisher
bound on kvEvents.port, topic kv@<pod IP>@<model> unless set (Kubernetes expands the variable). */}}
{{- define "mpc.vllm.kvEventsConfig" -}}
{{- $k := .d.kvEvents }}
{{- $topic := $k.topic | default (printf "kv@$(MOONCAKE_LOCAL_HOSTNAME)@%s" .d.model) }}
{{- toJson (dict "enable_kv_cache_events" true "publisher" "zmq" "endpoint" (printf "tcp://*:%d" (int $k.port)) "topic" $topic) }}
{{- end }}
