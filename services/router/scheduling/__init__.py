"""Where a request runs: the engine pool from the control plane and its connectors (the
engine-call seam, gRPC), the routing policies, the plan of one request and the circuit
breakers. Used by :mod:`..execution`."""
