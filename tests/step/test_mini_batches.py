"""exgrpo_pl.step.mini_batches: how a step's micro-batch statistics combine (the row dealing is tested with
the update, tests/step/test_update.py and test_official_loss.py)."""

import pytest
import torch

from exgrpo_pl.step.mini_batches import accumulate, averaged


def test_a_statistic_is_averaged_over_the_micro_batches_that_reported_it():
    # One update of two micro-batches, 3 rows and 1 row: replayed rows only in the second.
    totals, shares = {}, {}
    accumulate(totals, shares, {"loss": torch.tensor(2.0), "clip_ratio": torch.tensor(0.2)}, 1.0, 0.75)
    values = {"loss": torch.tensor(1.0), "clip_ratio": torch.tensor(0.6), "is_weight": torch.tensor(0.8)}
    accumulate(totals, shares, values, 1.0, 0.25)
    averaged(totals, shares)
    assert totals["loss"] == 3.0  # each micro-batch's loss is normalised by the update already: summed
    assert totals["clip_ratio"] == pytest.approx(0.75 * 0.2 + 0.25 * 0.6)
    assert totals["is_weight"] == pytest.approx(0.8)  # not 0.25 * 0.8: the first held no replayed row


def test_a_step_stopped_early_averages_what_it_ran():
    totals, shares = {}, {}
    accumulate(totals, shares, {"loss": torch.tensor(1.0), "clip_ratio": torch.tensor(0.4)}, 0.5, 0.25)
    averaged(totals, shares)  # the other three quarters of the step never ran (a non-finite loss)
    assert totals == {"loss": 0.5, "clip_ratio": pytest.approx(0.4)}
