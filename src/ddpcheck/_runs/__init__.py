"""How the front doors (``ddpcheck.api``, ``ddpcheck.cli``, the pytest plugin) assemble a run.

``example`` is the one path of a single example, from target and scenario to verdict, that every
door shares; ``fuzz`` draws random examples and shrinks a failure; ``survey`` the capability
matrix; ``replay`` builds and reads replay lines; ``trace`` records one step's collectives;
``torchrun`` checks inside a world torchrun built. May import every other private package.
"""
