"""What the connector tells operators and routers, off the data path: the events both sides
publish (`events`), metrics (`stats`, exported by `prom` from `metric_catalog`), traces
(`tracing`, `otlp_http`, `sampling`), time-to-first-token timelines (`ttft`), and KV events for
routers (`kv_events`)."""
