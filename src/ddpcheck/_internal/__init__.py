"""ddpcheck's private parts: no stability promise (the public surface is ``ddpcheck.__all__``).

The packages, in the order an example travels (docs/architecture.md draws the whole trip):

* ``options``, ``devices`` -- what a user can pass and where ranks compute; no torch at import.
* ``training``, ``records``, ``messages`` -- the one training loop every party runs, what it
  records, and how a scenario's problems are named: the scenario language's meaning, shared by
  the ranks, the reference and the checks.
* ``rank/`` -- what runs inside a rank process: serving tasks, the example, the recorder of
  collectives, the fitness check. Imports neither the world nor the oracle.
* ``world/`` -- the parent's side of a world: spawning, waiting with deadlines, diagnosing hangs
  and mismatches, cleaning up. Imports the rank only to spawn it; never the oracle.
* ``oracle/`` -- pure judgement on records: the reference, the comparisons, tolerances, budgets,
  and whether a scenario can be judged at all. Imports neither the world nor the rank.
* ``rules/`` -- the sharding-rule checker (``ddpcheck fuzz-rule``), in one place.
* ``runs/`` -- how the front doors assemble a run: one example (``example``), random examples
  (``fuzz``), the capability matrix (``survey``), replay lines, traces, torchrun's worlds.

``tests/test_architecture.py`` holds these arrows.
"""
