"""The simulated engine ("sim"): a GPU engine's timing from a profile, no compute (see
:mod:`.backend`; the profile format in :mod:`.profile`, admission in :mod:`.scheduler`)."""

from services.engines.sim.backend import SimBackend, SimOptions
from services.engines.sim.profile import SimProfile, SimProfileError, load_profile

__all__ = ["SimBackend", "SimOptions", "SimProfile", "SimProfileError", "load_profile"]
