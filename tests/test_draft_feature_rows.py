"""A request's feature rows kept in the blocks they arrived in (draft_service.feature_rows)."""

from __future__ import annotations

import torch

from draft_service.feature_rows import FeatureRows


def test_runs_give_the_rows_of_the_positions_asked_in_order_one_slice_per_unbroken_stretch_of_a_block():
    """A prompt's block (positions 0-5), a step's (6-8) that also replaces position 5, and positions asked with a
    hole (3): the rows are each position's latest, and the runs break where a block or a stretch ends."""
    prompt, step = torch.randn(6, 4), torch.randn(4, 4)
    rows = FeatureRows()
    rows.put(0, prompt)
    rows.put(5, step)  # positions 5-8: position 5 now takes the step's row 0
    asked = [0, 1, 2, 4, 5, 6, 7, 8]
    runs = rows.runs(asked)
    assert [run.shape[0] for run in runs] == [3, 1, 4]
    want = torch.stack([prompt[0], prompt[1], prompt[2], prompt[4], step[0], step[1], step[2], step[3]])
    assert torch.equal(torch.cat(runs), want)
    assert all(torch.equal(rows.row(p), row) for p, row in zip(asked, want))
    assert all(run._base is prompt or run._base is step for run in runs)  # slices of the blocks, not copies


def test_rows_before_first_are_not_kept_and_dropped_positions_are_gone():
    block = torch.randn(5, 2)
    rows = FeatureRows()
    rows.put(10, block, first=2)  # positions 10 and 11 were computed already
    assert sorted(rows) == [12, 13, 14] and len(rows) == 3 and 11 not in rows and rows.row(11) is None
    rows.drop(12, 14)
    assert sorted(rows) == [14] and torch.equal(rows.row(14), block[4])
    assert rows.runs([]) == []
