"""``python -m labs.bench``: see ``labs.bench``."""

import sys

from labs.bench import main

sys.exit(main())
