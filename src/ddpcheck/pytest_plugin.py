"""pytest plugin of ddpcheck (registered through the ``pytest11`` entry point).

Importing it must stay cheap and side-effect free: it imports neither torch nor hypothesis, and
never touches the user's Hypothesis profile.
"""

from __future__ import annotations


def pytest_sessionfinish(session, exitstatus):
    """Stop the persistent worlds this process started, so no rank outlives the session."""
    import sys

    world = sys.modules.get("ddpcheck.world")
    if world is not None:
        world.shutdown_worlds()
