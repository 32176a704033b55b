"""The ``pdserve`` console script."""
