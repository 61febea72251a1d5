"""PromQL building blocks shared by the dashboards, the renderer and the tests.

Metric names come from `connector/observability/metric_catalog.py` (which imports without
vLLM), vLLM's own families from a short allow-list, and the Mooncake
master's families are plain `master_*` names scraped from its metrics port.
"""

from __future__ import annotations

import re

from connector.observability import metric_catalog as CATALOG  # imports without vLLM

FAMILIES = {f.key: f for f in CATALOG.FAMILIES}

# vLLM core families the dashboards use (labels: model_name, engine), with their exported names.
VLLM_CORE = (
    "vllm:external_prefix_cache_hits_total",
    "vllm:external_prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:prefix_cache_queries_total",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count",
    "vllm:num_requests_running",
    "vllm:request_success_total",
)

# Families of the Mooncake master's HA state (every master exports them; a master without HA
# reads as a leader: state 0, lag 0). tests/test_ha_failover.py checks them on a live HA group.
MASTER_HA = (
    "ha_standby_state",  # 0 not a standby (leader), 3 a standby following the oplog, ...
    "ha_oplog_standby_lag",
    "ha_oplog_applied_sequence_id",
    "ha_state_transitions_total",
    "master_batch_put_end_items_total",
    "master_put_end_requests_total",
)

# Families a master in multi-tenant mode (--enable_multi_tenants) exports per tenant
# (label tenant_id); the counters appear once they count something. tests/e2e/test_tenants.py
# checks them on a live multi-tenant master.
MASTER_TENANT = (
    "mooncake_tenant_quota_charged_bytes",
    "mooncake_tenant_quota_effective_bytes",
    "mooncake_tenant_quota_reject_total",
    "mooncake_tenant_evict_bytes_total",
)
# Name prefixes of a master's own families (filtered by the master variable, not by engine).
MASTER_PREFIXES = ("master_", "ha_", "mooncake_tenant_", "file_cache_")

# Dashboard template variables, by the label they filter on.
VARIABLES = {"model_name": "model", "pod": "pod", "tp_rank": "tp_rank", "thread": "thread"}
MASTER_VARIABLE = ("instance", "master")
RATE = "$__rate_interval"


def exported_names() -> set[str]:
    """Every series name the connector exports (counters with _total, histograms expanded)."""
    names: set[str] = set()
    for f in CATALOG.FAMILIES:
        if f.kind == "histogram":
            names.update(f.name + s for s in ("_bucket", "_sum", "_count"))
        else:
            names.add(f.exported)
    return names


def _matchers(labels: tuple[str, ...], extra: dict[str, str]) -> str:
    parts = [f'{label}=~"${VARIABLES[label]}"' for label in labels if label in VARIABLES]
    for key, value in extra.items():
        op, val = (value[:2], value[2:]) if value[:2] in ("=~", "!=", "!~") else ("=", value)
        parts.append(f'{key}{op}"{val}"')
    return "{" + ", ".join(parts) + "}"


def series(key: str, suffix: str = "", **extra: str) -> str:
    """A connector series with every dashboard variable its family carries, e.g.
    `vllm:mooncake_pool_load_bytes_total{model_name=~"$model", pod=~"$pod", ...}`.
    `suffix` is `_bucket`/`_sum`/`_count` for histograms; extra matchers as `status="error"`
    (or `"=~regex"`, `"!=value"`)."""
    f = FAMILIES[key]
    name = f.name + suffix if f.kind == "histogram" else f.exported
    return name + _matchers(("model_name", "pod") + tuple(f.labels), extra)


def vllm(name: str, **extra: str) -> str:
    """A vLLM core series filtered by model and pod."""
    assert name in VLLM_CORE, name
    return name + _matchers(("model_name", "pod"), extra)


def master(name: str) -> str:
    """A Mooncake master series filtered by the master instance variable."""
    label, var = MASTER_VARIABLE
    return f'{name}{{{label}=~"${var}"}}'


def rate(selector: str, by: str | None = None, agg: str = "sum") -> str:
    grouping = f" by ({by})" if by is not None else ""
    return f"{agg}{grouping} (rate({selector}[{RATE}]))"


def quantile_of(q: float, bucket_selector: str, by: str = "") -> str:
    """histogram_quantile over the rate of a `_bucket` selector, grouped by le (+ `by`)."""
    grouping = "le" + (f", {by}" if by else "")
    return f"histogram_quantile({q}, sum by ({grouping}) (rate({bucket_selector}[{RATE}])))"


def quantile(q: float, key: str, by: str = "") -> str:
    """histogram_quantile of a connector histogram (by its catalog key)."""
    return quantile_of(q, series(key, "_bucket"), by)


# --- metric names inside an expression --------------------------------------------------------

_KEYWORDS = {
    "sum", "min", "max", "avg", "count", "stddev", "stdvar", "topk", "bottomk", "quantile",
    "count_values", "group", "by", "without", "on", "ignoring", "group_left", "group_right",
    "and", "or", "unless", "offset", "bool", "inf", "nan", "atan2",
}
_IDENT = re.compile(r"(?<![\w:$.])([A-Za-z_:][A-Za-z0-9_:]*)(?![\w:])\s*(\()?")


def metric_names(expr: str) -> set[str]:
    """The metric names an expression selects (function names, keywords, label names, strings,
    range durations and Grafana variables are skipped)."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    s = re.sub(r"\{[^}]*\}", "", s)  # label matchers
    s = re.sub(r"\[[^\]]*\]", "", s)  # ranges / subqueries
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", s)
    names = set()
    for m in _IDENT.finditer(s):
        word, call = m.group(1), m.group(2)
        if call or word.lower() in _KEYWORDS:
            continue
        names.add(word)
    return names


def substitute(expr: str, rate_interval: str = "1m", **values: str) -> str:
    """Replace Grafana variables for a direct Prometheus query: every label variable defaults
    to `.*` (Grafana's "All"), `$__rate_interval` to `rate_interval`."""
    out = expr.replace("$__rate_interval", rate_interval)
    for var in list(VARIABLES.values()) + [MASTER_VARIABLE[1]]:
        out = out.replace(f"${var}", values.get(var, ".*"))
    return out
