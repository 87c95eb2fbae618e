"""One labelled comparison of tensors for the kernel, reference and model tests."""

from __future__ import annotations

import torch


def assert_close(
    got: torch.Tensor,
    want: torch.Tensor,
    *,
    what: str,
    atol: float = 0.0,
    rtol: float = 0.0,
    of_peak: float | None = None,
    peak_floor: float = 0.0,
    same_dtype: bool = False,
) -> None:
    """``got`` within ``atol + rtol·|want|`` of ``want`` at every element
    (``torch.allclose``'s rule, with no default tolerance), or with ``of_peak``
    within ``of_peak · max(max|want|, peak_floor)`` everywhere (an error measured
    against the largest value). Compared in float64; equal infinities are close, a
    NaN never is. Fails
    naming ``what``, how many values are off, the worst one's index, both values
    there and the error against its bound. ``same_dtype``: the dtypes must match
    too (as ``torch.testing.assert_close`` requires)."""
    if same_dtype:
        assert got.dtype == want.dtype, (
            f"{what}: dtype {got.dtype}, expected {want.dtype}"
        )
    got_wide = torch.as_tensor(got).detach().to("cpu", torch.float64)
    want_wide = torch.as_tensor(want).detach().to("cpu", torch.float64)
    assert got_wide.shape == want_wide.shape, (
        f"{what}: shape {tuple(got_wide.shape)}, expected {tuple(want_wide.shape)}"
    )
    error = (got_wide - want_wide).abs()
    if of_peak is not None:
        peak = want_wide.abs().max() if want_wide.numel() else torch.tensor(0.0)
        bound = torch.full_like(error, of_peak * max(float(peak), peak_floor))
    else:
        bound = atol + rtol * want_wide.abs()
    # Equal values are close, infinities included (as in torch.allclose).
    off = ~((got_wide == want_wide) | (error <= bound))
    if not bool(off.any()):
        return
    excess = torch.where(off, (error - bound).nan_to_num(float("inf")), -1.0)
    worst = tuple(int(i) for i in torch.unravel_index(excess.argmax(), excess.shape))
    raise AssertionError(
        f"{what}: {int(off.sum())} of {off.numel()} values off; worst at {worst}: "
        f"got {float(got_wide[worst]):.6g}, expected {float(want_wide[worst]):.6g}, "
        f"error {float(error[worst]):.3e} > bound {float(bound[worst]):.3e}"
    )
