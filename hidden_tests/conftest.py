"""Settings of the hidden tests (instructor-only, never released; the grader copies this file into
each hidden run beside the lab's hidden tests)."""

import pytest

from labs.runtime.device import one_thread


@pytest.fixture(autouse=True)
def _one_intra_op_thread():
    """Compute in this process on one thread, as every launched rank does: the references and the
    single-process checks here are tiny, and on a busy machine torch's spinning OpenMP workers
    make them many times slower while ranks run (``labs.runtime.device.one_thread``)."""
    with one_thread():
        yield
