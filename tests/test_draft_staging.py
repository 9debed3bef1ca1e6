"""Host rows on their way to the device through a staged buffer, a chunk at a time (draft_service.staging)."""

from __future__ import annotations

import torch

from draft_service.staging import StagedInput, staged_chunks


def test_runs_of_host_rows_pass_through_a_staged_buffer_in_chunks_that_equal_their_rows():
    """Seven rows in runs of 2, 4 and 1 through a three-row stage: chunks of 3, 3 and 1 at rows 0, 3 and 6
    (runs split across chunks), each equal to those rows (float32 rows into a bfloat16 stage, as the feature
    rows of a gRPC ingest reach a bf16 draft)."""
    rows = torch.randn(7, 5)
    runs = [rows[0:2], rows[2:6], rows[6:7]]
    stage = StagedInput((3, 5), torch.bfloat16, torch.device("cpu"))
    seen = []
    for at, chunk in staged_chunks(stage, runs):
        assert torch.equal(chunk, rows[at: at + len(chunk)].to(torch.bfloat16))
        seen.append((at, len(chunk)))
    assert seen == [(0, 3), (3, 3), (6, 1)]


def test_a_run_as_long_as_the_stage_fills_one_chunk_and_leaves_none_empty():
    rows = torch.randn(6, 2)
    stage = StagedInput((3, 2), torch.float32, torch.device("cpu"))
    got = [(at, chunk.clone()) for at, chunk in staged_chunks(stage, [rows[:3], rows[3:]])]
    assert [at for at, _ in got] == [0, 3]
    assert all(torch.equal(chunk, rows[at: at + 3]) for at, chunk in got)


def test_no_chunk_comes_of_no_rows():
    assert list(staged_chunks(StagedInput((4, 2), torch.float32, torch.device("cpu")), [])) == []
