"""Grafana dashboards and Prometheus alert rules for the pooled Mooncake store connector.

`generate.py` builds the dashboards from code (grafana-foundation-sdk, Grafana 11.6 flavour) into
the committed JSON files; `render.py` draws their panels from a live Prometheus with matplotlib;
`alerts.yaml` holds the alert rules and `alerts_test.yaml` their promtool unit tests.
"""
