"""``python -m ddpcheck`` is the ``ddpcheck`` command line (``ddpcheck.cli``)."""

from ddpcheck.cli import command

if __name__ == "__main__":
    command()
