"""``python -m labs.check``: see ``labs.check``."""

import sys

from labs.check import main

sys.exit(main())
