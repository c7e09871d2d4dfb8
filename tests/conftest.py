"""Shared fixtures. Tests reach exercise code only through ``exercise`` (the fixture, or
``labs.runtime.exercise``), never by importing learner names; ../conftest.py selects solutions."""

import matplotlib
import pytest

from labs.runtime.impl import exercise as _exercise

matplotlib.use("Agg")  # every test draws headless: widgets and charts render to memory


@pytest.fixture
def exercise():
    """``exercise("ddp")`` -> the selected implementation's module."""
    return _exercise
