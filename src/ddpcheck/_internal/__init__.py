"""Internals of ddpcheck: no stability promise. Processes, rendezvous and deadlines (world, rank,
failures), what crosses the wire (recorder, sequences, transport), and the one training loop
(train, runner, records)."""
