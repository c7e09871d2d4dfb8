"""Exercise 04, part 1: Megatron's conjugate operators (``tensor_parallel_comm``) and the async
linear of §11 (``LinearWithAsyncCommunication``) forward and backward against their definitions,
on 2 and 4 ranks."""

import pytest

from labs.experiments.tp_parts import check_async_linear, check_operators


@pytest.mark.exercise
@pytest.mark.parametrize(
    "sp", [False, pytest.param(True, marks=pytest.mark.part("sequence-parallel"))]
)
@pytest.mark.parametrize("nproc", [2, 4])
def test_conjugate_operators_forward_and_backward(nproc, sp):
    # float64: only the rounding of the sums remains. The core: f, g and the gather/scatter pair
    # along the last dim; the sequence-parallel extension adds SP's all-gather/reduce-scatter pair.
    operators = check_operators(nproc=nproc, sp=sp)
    assert len(operators) == (6 if sp else 4)
    for name, diff in operators.items():
        assert diff["forward"] < 1e-12 and diff["backward"] < 1e-12, (name, diff)


@pytest.mark.exercise
@pytest.mark.part("async")
@pytest.mark.parametrize("nproc, sp", [(2, False), (2, True), (4, False), (4, True)])
def test_async_linear_forward_and_backward(nproc, sp):
    # §11: LinearWithAsyncCommunication with 3 weights (q/k/v) and 1 (the head), float64
    for name, diff in check_async_linear(nproc=nproc, sp=sp).items():
        assert diff["forward"] < 1e-12 and diff["backward"] < 1e-12, (name, diff)
