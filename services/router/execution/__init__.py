"""Carrying a planned request out on the engines: the executor, its bounded engine calls, the
forked ``n > 1`` run, failover and migration, and what one generation is (request, chunks,
run info). Uses :mod:`..scheduling`; used by the front end."""
