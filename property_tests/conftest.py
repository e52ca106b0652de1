"""Hypothesis profiles for the property tests.

"ci" (the default) is derandomized, so every run draws the same examples, with a
bounded number of examples per test and no per-example deadline (each new shape
compiles). Set HYPOTHESIS_PROFILE=dev for a longer randomized search (200
examples a test, or HYPOTHESIS_MAX_EXAMPLES), e.g.
``HYPOTHESIS_PROFILE=dev .venv/bin/python -m pytest -q property_tests``.
"""

import os
import sys

from hypothesis import HealthCheck, settings

# np_attention (tests/) and strategies (here) are imported as top-level modules.
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
sys.path.insert(0, os.path.dirname(__file__))

_SLOW_OK = [HealthCheck.too_slow, HealthCheck.data_too_large]

settings.register_profile("ci", derandomize=True, max_examples=8, deadline=None,
                          print_blob=True, suppress_health_check=_SLOW_OK)
_DEV_EXAMPLES = int(os.environ.get("HYPOTHESIS_MAX_EXAMPLES", 200))
settings.register_profile("dev", max_examples=_DEV_EXAMPLES, deadline=None, print_blob=True,
                          suppress_health_check=_SLOW_OK)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
