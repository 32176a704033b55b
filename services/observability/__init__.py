"""Observability that runs next to the system: a local Prometheus with the chart's rules."""
