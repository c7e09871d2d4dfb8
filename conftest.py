"""Suite-wide settings, for tests/ and for the notebooks nbval runs: the reference solutions run
unless LABS_IMPL says otherwise (the stub check sets it to "labs")."""

import os

os.environ.setdefault("LABS_IMPL", "solutions")
