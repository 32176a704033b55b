"""The router service. Not built yet: see docs/architecture.md, "Status"."""
