"""Calling an engine service: the :class:`~.connector.EngineConnector` seam and the clients
that implement it (:mod:`.h2`, the default; :mod:`.grpc_aio`)."""
