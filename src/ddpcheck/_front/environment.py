"""What the ``ddpcheck`` command sets in its own process's environment before it runs (its
children inherit it): never on import, never for the API or the pytest plugin. No torch here."""

from __future__ import annotations

import os

__all__ = ["keep_hypothesis_out_of_the_current_folder"]


def keep_hypothesis_out_of_the_current_folder() -> None:
    """Hypothesis keeps files in ``.hypothesis/`` of the current folder (``check`` passes
    ``database=None``, but Hypothesis 6.13x+ caches the constants of the modules it draws near in
    ``.hypothesis/constants/`` all the same): the ``ddpcheck`` command points Hypothesis's own
    storage setting, ``HYPOTHESIS_STORAGE_DIRECTORY``, at ddpcheck's cache folder instead, unless
    the user set it (set it to ``.hypothesis`` for Hypothesis's default). Only this process and
    its children: ``cli.main``'s callers, the API and the pytest plugin keep the user's
    Hypothesis as it is."""
    if not os.environ.get("HYPOTHESIS_STORAGE_DIRECTORY"):
        cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        os.environ["HYPOTHESIS_STORAGE_DIRECTORY"] = os.path.join(cache, "ddpcheck", "hypothesis")
