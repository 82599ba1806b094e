"""A restarted replica's first-step costs in the emulator (harness.run.seams.FirstStepCosts)."""

import pytest

from harness.run.seams import FirstStepCosts


@pytest.mark.parametrize("steps, owed", [
    # computes at once: the first batch and the first-step extra both land on its first forward
    ((True, True), [5.0 + 180.0, 0.0]),
    # heals first (zero gradient): the batch lands on the healing step, the extra on the first forward
    ((False, True, True), [5.0, 180.0, 0.0]),
    # heals twice (a retried catch-up step): the extra waits for the first forward
    ((False, False, True), [5.0, 0.0, 180.0]),
])
def test_first_step_costs_land_on_the_first_batch_and_the_first_forward(steps, owed):
    costs = FirstStepCosts(batch_s=5.0, extra_s=180.0)
    assert [costs.take(forward=f) for f in steps] == owed


def test_an_incarnation_that_warmed_up_before_check_in_owes_only_its_batch():
    costs = FirstStepCosts(batch_s=5.0, extra_s=0.0)
    assert [costs.take(forward=False), costs.take(forward=True)] == [5.0, 0.0]
