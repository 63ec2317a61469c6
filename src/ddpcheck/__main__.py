"""``python -m ddpcheck`` is the ``ddpcheck`` command line (``ddpcheck.cli``)."""

import sys

from ddpcheck.cli import main

if __name__ == "__main__":
    sys.exit(main())
