"""pdserve: disaggregated prefill/decode LLM serving.

Packages (each one job; see docs/architecture.md):

- ``topology``: layer and KV-head ranges of PP x TP workers, and the transfer plan.
- ``control_plane``: engine registry, leases, generations and handshake aggregation in Redis.
- ``config``: settings shared by the services (Redis, leases).
- ``cli``: the ``pdserve`` console script.
- ``bench``: benchmarks printing JSON.
- ``prefill``, ``decode``, ``router``: the three services.
"""
