"""The stub engine ("stub"): instant deterministic tokens, no model (see :mod:`.backend`)."""

from services.engines.stub.backend import StubBackend, StubOptions

__all__ = ["StubBackend", "StubOptions"]
