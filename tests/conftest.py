"""Suite-wide settings: under CI (`CI` set, CI runs with `CI=true`) Hypothesis runs the `ci` profile.

The `ci` profile has no per-example deadline (the CI machine is a noisy 2-core box, where a 200 ms
deadline fails healthy tests now and then) and is derandomized, so that a CI run is reproducible: the same
examples on every run, a failure that shows once shows again.
"""

from __future__ import annotations

from hypothesis import settings

from tests.support.ci import CI_PROFILE, hypothesis_profile

settings.register_profile(CI_PROFILE, deadline=None, derandomize=True, print_blob=True)
settings.load_profile(hypothesis_profile())
