"""The parent's side of a world: spawn W rank processes, hand them tasks, wait with deadlines.

``worlds`` holds :class:`~ddpcheck._world.worlds.World`; ``registry`` the persistent worlds (one
per size, backend, device, start method); ``lending`` the waits a thread lends another;
``processes`` the process plumbing; ``failures`` what a failed run reports; ``sequences`` the
diagnosis of collective sequences (the first collective where ranks disagree); ``janitor`` the
process that cleans up when the parent dies. Imports the rank package only to spawn it
(``_rank.serve``) and to read what ranks send (``_rank.transport``, ``_rank.freshness``); never
the oracle.
"""
