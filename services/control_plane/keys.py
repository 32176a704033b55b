"""Redis key layout of one control-plane namespace (``pdserve:<namespace>:...``).

=====================================  =========  ==========================================
key                                    type       meaning (TTL)
=====================================  =========  ==========================================
``engines``                            zset       engine ids ever registered and not removed
``gen:<engine>``                       string     last generation (no TTL; >= wall-clock ms)
``cur:<engine>``                       string     current generation (lease TTL)
``engine:<engine>``                    string     EngineRecord (lease TTL)
``status:<engine>``                    string     EngineStatus (lease TTL)
``load:<engine>``                      string     EngineLoad (lease TTL)
``hs:<engine>:<gen>``                  hash       ``"pp:tp"`` -> HandshakeRecord (lease TTL)
``owners:<engine>:<gen>``              hash       ``"pp:tp"`` -> worker id (lease TTL)
``hsver:<engine>:<gen>``               string     handshake version, +1 per write (lease TTL)
``events``                             channel    Event messages
=====================================  =========  ==========================================

Engine ids are validated (:func:`validate_identifier`) before they become part of a key.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.control_plane.wire import EngineId, Generation, validate_identifier


@dataclass(frozen=True)
class KeySpace:
    """Key names of one namespace."""

    namespace: str

    @property
    def prefix(self) -> str:
        return f"pdserve:{self.namespace}"

    @property
    def engines(self) -> str:
        return f"{self.prefix}:engines"

    @property
    def events(self) -> str:
        return f"{self.prefix}:events"

    def generation_counter(self, engine_id: EngineId) -> str:
        return f"{self.prefix}:gen:{validate_identifier(engine_id)}"

    def current(self, engine_id: EngineId) -> str:
        return f"{self.prefix}:cur:{validate_identifier(engine_id)}"

    def engine(self, engine_id: EngineId) -> str:
        return f"{self.prefix}:engine:{validate_identifier(engine_id)}"

    def status(self, engine_id: EngineId) -> str:
        return f"{self.prefix}:status:{validate_identifier(engine_id)}"

    def load(self, engine_id: EngineId) -> str:
        return f"{self.prefix}:load:{validate_identifier(engine_id)}"

    def handshakes(self, engine_id: EngineId, generation: Generation) -> str:
        return f"{self.prefix}:hs:{validate_identifier(engine_id)}:{generation}"

    def owners(self, engine_id: EngineId, generation: Generation) -> str:
        return f"{self.prefix}:owners:{validate_identifier(engine_id)}:{generation}"

    def handshake_version(self, engine_id: EngineId, generation: Generation) -> str:
        return f"{self.prefix}:hsver:{validate_identifier(engine_id)}:{generation}"

    def lease_keys(self, engine_id: EngineId, generation: Generation) -> list[str]:
        """Every key whose TTL is the engine's lease, in the order the scripts expect."""
        return [
            self.current(engine_id),
            self.engine(engine_id),
            self.status(engine_id),
            self.load(engine_id),
            self.handshakes(engine_id, generation),
            self.owners(engine_id, generation),
            self.handshake_version(engine_id, generation),
        ]
