"""Hypothesis profiles for ddpcheck's own properties.

``ci`` (the default): modest example counts, derandomized, no example database -- the CI run is
reproducible and stays inside its time budget (>= 1,000 examples in <= 5 minutes on 2 cores).
``thorough``: many more examples with a database, for exploring; select it with
``DDPCHECK_PROFILE=thorough``. This only applies to this repository's test session: loading the
ddpcheck pytest plugin elsewhere never touches the user's profile.
"""

import os

from hypothesis import HealthCheck, settings

_COMMON = dict(
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("ci", max_examples=70, derandomize=True, database=None, **_COMMON)
settings.register_profile("thorough", max_examples=1500, **_COMMON)
settings.load_profile(os.environ.get("DDPCHECK_PROFILE", "ci"))
