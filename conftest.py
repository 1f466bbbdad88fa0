"""Repository-wide pytest set-up, loaded for every package's tests (the rootdir is the repo).

Hypothesis: the property tests check correctness, not speed, and CI machines have two cores
shared with spawned rank processes, so a slow draw or a slow example must not fail a run.
"""

from __future__ import annotations

try:
    from hypothesis import HealthCheck, settings
except ImportError:  # a package whose tests do not use hypothesis
    pass
else:
    settings.register_profile("afd", deadline=None, suppress_health_check=[HealthCheck.too_slow])
    settings.load_profile("afd")
