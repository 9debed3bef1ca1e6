"""Host rows on their way to the device through a staged buffer, a chunk at a time (draft_service.staging)."""

from __future__ import annotations

import torch

from draft_service.staging import StagedInput, staged_chunks


def test_host_rows_pass_through_a_staged_buffer_in_chunks_that_equal_their_stack():
    """Seven rows through a three-row stage: chunks of 3, 3 and 1 at rows 0, 3 and 6, each the rows' stack
    (float32 rows into a bfloat16 stage, as the feature rows of a gRPC ingest reach a bf16 draft)."""
    rows = [torch.randn(5) for _ in range(7)]
    stage = StagedInput((3, 5), torch.bfloat16, torch.device("cpu"))
    seen = []
    for at, chunk in staged_chunks(stage, rows):
        assert torch.equal(chunk, torch.stack(rows[at: at + len(chunk)]).to(torch.bfloat16))
        seen.append((at, len(chunk)))
    assert seen == [(0, 3), (3, 3), (6, 1)]


def test_no_chunk_comes_of_no_rows():
    assert list(staged_chunks(StagedInput((4, 2), torch.float32, torch.device("cpu")), [])) == []
