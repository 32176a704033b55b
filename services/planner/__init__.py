"""The prefill:decode planner (issue 32): every interval it reads the router's figures over
HTTP, predicts the next interval's load and sizes each pool for the SLOs from an engine profile
(:mod:`.sizing`, :mod:`.predictors`, :mod:`.decision`, :mod:`.observe`, :mod:`.plan`; the loop in
:mod:`.main`). It publishes what it wants and why; it does not start or stop engines yet.

Above it: ``cli``. Below it: ``engines`` (the simulated engine's profile format) and
``serving`` (the ready line). It never imports the router: the router's metric names are
strings read from its ``/metrics`` text.
"""
