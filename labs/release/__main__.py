"""``python -m labs.release``: see ``labs.release``."""

import sys

from labs.release import main

sys.exit(main())
