"""The start-up profile's linear fit (gateway/profiling.py): least squares with no negative coefficient."""

from __future__ import annotations

import pytest
import torch

from gateway.profiling import _fit

# Draft calls as the profile makes them: (1, levels, expansions) for the three auto options at 1 and 4 requests.
DRAFT_ROWS = [[1.0, 3, 3], [1.0, 3, 12], [1.0, 5, 20], [1.0, 5, 80], [1.0, 6, 48], [1.0, 6, 192]]


def test_a_fit_of_exact_non_negative_costs_returns_them():
    ys = [7.0 + 0.5 * levels + 3.0 * expansions for _, levels, expansions in DRAFT_ROWS]
    assert _fit(DRAFT_ROWS, ys) == pytest.approx([7.0, 0.5, 3.0])


def test_a_slope_that_noise_makes_negative_is_dropped_and_the_rest_refitted_not_clamped():
    # No cost per level (as with --emulate-step-cost), and noise on the shallow calls: unconstrained,
    # the per-level slope comes out negative and the base too high to make up for it.
    noise = [4.0, 4.0, 0.0, 0.0, -1.0, -2.0]
    ys = [7.0 + 3.0 * expansions + n for (_, _, expansions), n in zip(DRAFT_ROWS, noise, strict=True)]
    free = torch.linalg.lstsq(torch.tensor(DRAFT_ROWS, dtype=torch.float64),
                              torch.tensor(ys, dtype=torch.float64)[:, None]).solution[:, 0].tolist()
    assert free[1] < 0 and free[0] > 12
    base, per_level, per_expansion = _fit(DRAFT_ROWS, ys)
    assert per_level == 0.0
    # The other two are the least-squares fit without the level column: the base is back near 7 ms.
    without_levels = torch.linalg.lstsq(torch.tensor(DRAFT_ROWS, dtype=torch.float64)[:, [0, 2]],
                                        torch.tensor(ys, dtype=torch.float64)[:, None]).solution[:, 0].tolist()
    assert [base, per_expansion] == pytest.approx(without_levels)
    assert base < 10 and per_expansion == pytest.approx(3.0, abs=0.05)
    # And the clamped fit predicts every call worse than the refit does.
    clamped = [max(c, 0.0) for c in free]
    for row, y in zip(DRAFT_ROWS, ys, strict=True):
        refit_error = abs(base * row[0] + per_level * row[1] + per_expansion * row[2] - y)
        clamped_error = abs(sum(c * x for c, x in zip(clamped, row, strict=True)) - y)
        assert refit_error <= clamped_error + 1e-9


def test_times_that_fall_with_every_column_fit_to_zero_costs():
    rows = [[1.0, 1.0], [1.0, 2.0], [1.0, 3.0]]
    assert _fit(rows, [-1.0, -2.0, -3.0]) == [0.0, 0.0]
