"""The engine host: what ``pdserve prefill`` and ``pdserve decode`` run around an engine
backend (see :mod:`.engine_host`)."""
