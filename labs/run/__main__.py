"""``python -m labs.run``: see ``labs.run``."""

import sys

from labs.run import main

sys.exit(main())
