"""evaluation.py: a timed-out run's evaluation fits in the job's margin, and its memory peak is its own."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import ManualClock
from ftbench.tasks import registry
from ftbench.train import evaluation, trainer


def test_eval_batches_stop_while_the_reserve_for_writing_is_still_left():
    clock = ManualClock()
    budget = evaluation.EvalBudget(limit=10.0, reserve=2.0, clock=clock)
    fits = []
    for _ in range(8):
        fits.append(budget.another_batch_fits())
        clock.now += 2.5  # each batch takes 2.5 s
    # Batches start at 0, 2.5 and 5; at 7.5 another 2.5 s batch plus the 2 s reserve would pass 10.
    assert fits[:4] == [True, True, True, False]


def test_a_part_of_several_units_is_expected_to_take_that_many_of_the_slowest_unit_so_far():
    clock = ManualClock()
    budget = evaluation.EvalBudget(limit=20.0, reserve=1.0, clock=clock)
    assert budget.another_batch_fits(8)  # nothing timed yet
    clock.now += 2.0  # those 8 rows took 2 s: 0.25 s a row
    assert budget.another_batch_fits(32)  # 2 + 32 x 0.25 + 1 < 20
    clock.now += 12.0  # those 32 took 0.375 s each
    assert not budget.another_batch_fits(32)  # 14 + 32 x 0.375 + 1 > 20
    assert budget.another_batch_fits(8)  # 14 + 8 x 0.375 + 1 < 20


def test_an_evaluation_a_limit_may_end_is_a_probe_then_the_rest_at_once_where_it_fits_twice_over():
    asked = []

    def fits(answers):
        answers = iter(answers)
        return lambda rows: asked.append(rows) or next(answers)

    assert list(evaluation.rounds(1000, 128, None)) == [(0, 1000)] and list(evaluation.rounds(0, 8, None)) == []
    assert list(evaluation.rounds(1000, 128, fits([True, True]))) == [(0, 32), (32, 1000)]
    assert asked == [32, 2 * 968]
    # Where the rest does not fit twice over: rounds of ROUND_BATCHES batches, each asked for, until one does not fit.
    tight = list(evaluation.rounds(1000, 128, fits([True, False, True, False, False])))
    assert tight == [(0, 32), (32, 32 + evaluation.ROUND_BATCHES * 128)]
    assert list(evaluation.rounds(1000, 128, fits([False]))) == []


def test_without_a_limit_every_batch_fits():
    budget = evaluation.EvalBudget(limit=None, reserve=0.0)
    assert all(budget.another_batch_fits() for _ in range(100))


def test_eval_peak_is_reset_and_read_apart_from_trainings():
    """/proc/self/clear_refs resets the high-water mark (VmHWM): evaluation's peak is not training's."""
    held = np.ones(64 * 2**20 // 8)  # 64 MiB, touched
    before = evaluation.peak_rss_mb()
    del held
    assert evaluation.reset_peak_rss()
    after = evaluation.peak_rss_mb()
    assert after < before - 32  # the earlier peak no longer counts


@pytest.mark.slow
def test_evaluation_cut_short_counts_the_samples_scored(tiny_config_factory, prepared_data):
    """evaluate() asks before each batch; a run's metrics say how many examples were scored and why."""
    from ftbench.data import prepared
    from ftbench.experiment import matrix
    from ftbench.train import modeling
    import torch

    config = tiny_config_factory(defaults={**tiny_config_factory()["defaults"], "eval_batch_size": 4},
                                 matrix={"model": ["tiny"], "dataset": ["tiny"]})
    (spec,) = matrix.expand_runs(config)
    folder, manifest = prepared_data
    split = registry.load_split(folder, "eval", prepared.verify(folder))
    built = modeling.build_model(spec, num_labels=len(manifest["label_names"]), device=torch.device("cpu"),
                                 pad_token_id=manifest["pad_token_id"])
    answers = iter([True, False, True, False, False])  # the probe (1 row), not all the rest, one round, no more
    figures = trainer.evaluate(built.model, split, spec, "classification", torch.device("cpu"), manifest["pad_token_id"],
                               another_batch_fits=lambda rows: next(answers))
    scored = 1 + 4 * evaluation.ROUND_BATCHES
    assert figures["eval_samples"] == scored and figures["eval_samples_planned"] == len(split) > scored
    assert 0 <= figures["eval_accuracy"] <= 1
