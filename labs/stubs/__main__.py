"""``python -m labs.stubs``: see ``labs.stubs``."""

import sys

from labs.stubs import main

sys.exit(main())
