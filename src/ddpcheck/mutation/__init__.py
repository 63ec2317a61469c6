"""The self-test: the mutant catalogue (the parallel target with one seeded bug each), the searches
that hunt them, and the scoring of the mutant table. Nothing in the core imports this package."""
