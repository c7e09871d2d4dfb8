"""``python -m labs.grade``: see ``labs.grade``."""

import sys

from labs.grade import main

sys.exit(main())
