"""The few-row linear layer (kernels/gemv.py): F.linear's result for 1-4 rows, any shape, with and
without a bias; and the dispatch that keeps F.linear wherever the GEMV is off or does not apply.
On CPU the kernel runs under TRITON_INTERPRET=1 (tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import gemv
from tests.test_kernels import DEVICES, TOL


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
def test_the_gemv_gives_f_linears_result_for_a_few_rows(device, dtype, rows, with_bias):
    g = torch.Generator(device).manual_seed(rows)
    # N and K not multiples of the tiles: the last column block and K step are masked.
    weight = torch.randn(70, 300, generator=g, device=device).to(dtype)
    bias = torch.randn(70, generator=g, device=device).to(dtype) if with_bias else None
    x = torch.randn(rows, 300, generator=g, device=device).to(dtype)
    got = gemv.linear_gemv(x, weight, bias)
    assert got.shape == (rows, 70) and got.dtype == dtype
    expect = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    tolerance = TOL[dtype] if dtype != torch.float32 else dict(atol=1e-4, rtol=1e-4)  # sums of 300 products
    torch.testing.assert_close(got.float(), expect, **tolerance)


@pytest.mark.parametrize("device", DEVICES)
def test_the_gemv_keeps_leading_dimensions_and_refuses_what_it_cannot_take(device):
    x = torch.randn(2, 1, 8, device=device)
    weight = torch.randn(5, 8, device=device)
    assert gemv.linear_gemv(x, weight).shape == (2, 1, 5)
    with pytest.raises(ValueError, match="does not fit"):
        gemv.linear_gemv(x, torch.randn(5, 7, device=device))
    with pytest.raises(ValueError, match="at most"):
        gemv.linear_gemv(torch.randn(gemv.MAX_ROWS + 1, 8, device=device), weight)


def test_the_linear_layer_is_f_linear_unless_the_gemv_is_on_for_few_rows_on_a_gpu(monkeypatch):
    calls = []
    monkeypatch.setattr(gemv, "linear_gemv", lambda *args: calls.append(args) or F.linear(*args))
    weight = torch.randn(5, 8)
    x = torch.randn(1, 8)
    monkeypatch.setattr(gemv, "ENABLED", True)
    torch.testing.assert_close(gemv.linear(x, weight), F.linear(x, weight))
    assert not calls  # on the CPU: F.linear
    if torch.cuda.is_available():
        gemv.linear(x.cuda(), weight.cuda())
        gemv.linear(torch.randn(gemv.MAX_ROWS + 1, 8, device="cuda"), weight.cuda())
        assert len(calls) == 1  # the few-row call only
        monkeypatch.setattr(gemv, "ENABLED", False)
        gemv.linear(x.cuda(), weight.cuda())
        assert len(calls) == 1
