"""``python -m convgrad``: the same commands as the ``convgrad`` script."""

import sys

from convgrad.cli import main

if __name__ == "__main__":
    sys.exit(main())
