"""``python -m labs.theory COMMAND ...``: the calculators' command line, ``labs.theory.cli``."""

import sys

from labs.theory.cli import main

if __name__ == "__main__":
    sys.exit(main())
