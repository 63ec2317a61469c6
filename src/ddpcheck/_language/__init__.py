"""The scenario language: what an example *is* -- its model (``models``, ``zoo``), its batch rule
(``batches``), the fixed battery and the random strategies, the features an example exercises, and
the one training loop every party runs (``training``), what it records (``records``), its
objective and how a scenario's problems are named (``messages``). Ranks, the reference and the
checks all read it; it reads only ``_base``. The public modules ``ddpcheck.scenario``,
``ddpcheck.zoo`` ... are its names.
"""
