"""The prefill service. Not built yet: see docs/architecture.md, "Status"."""
