"""Errors of the topology package.

::

    LayoutError (ValueError)   a layer split, head range or layout that cannot exist
"""


class LayoutError(ValueError):
    """A PP x TP layout that cannot exist (empty stage, heads that do not divide, bad range)."""
