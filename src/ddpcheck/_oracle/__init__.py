"""The oracle: pure judgement on records, in the checking process.

``reference`` trains the single-process full-batch reference; ``compare`` holds every rank's
records to each other (bitwise) and to the reference (within ``tolerances``), with the optimizer
state, the LR schedule and a resumed run; ``budget`` what crossed the wire; ``shards`` each rank's
local shard; ``sample_weights`` the batch plans' weighing of samples; ``judgeable`` whether a
scenario can be judged at all. Functions of their
arguments: imports the scenario language, ``training`` and ``records``; never the world or the rank.
"""
