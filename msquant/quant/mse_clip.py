"""MSE clipping search for round-to-nearest scales (pure functions, off unless asked for).

Plain min/max parameters make the grid span the whole observed range of a row (or row-group), so
one large value stretches the step for every other value. The search tries shrunken ranges
``[p * min, p * max]`` for ``p = 1, 1 - 1/grid, 1 - 2/grid, ..., 1 - maxshrink`` (both ends
included when ``1 - maxshrink`` lies on the grid), turns each into ``(scale, offset)`` with
:func:`~msquant.quant.int_quant.compute_qparams` (same widening to zero, epsilon floor and signed
codes as plain min/max), fake-quantizes the values with it and keeps, per row or group, the ``p``
with the smallest ``sum |w - w_q|^norm``. Ties keep the larger range (the earlier ``p``), so
``p = 1`` (plain min/max, bit for bit) wins unless a shrunken range is strictly better.

Everything is float32, vectorised over rows and groups (the only loop is over the grid) and
deterministic; the extra memory is one temporary of the searched tensor's size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from msquant.quant.int_quant import compute_qparams, minmax_qparams, qrange

__all__ = [
    "MAX_SEARCH_GRID",
    "MSEOptions",
    "grid_problem",
    "mse_option_problems",
    "shrink_factors",
    "mse_qparams",
    "mse_minmax_qparams",
    "range_qparams",
    "weight_qparams",
]


#: The finest search grid accepted (``mse_grid``, ``clip_grid``): the search quantizes the weight
#: once per ``1 / grid`` step of the shrink, so its cost grows with the grid; 1000 steps a range
#: in 0.1 % steps (the defaults: 100 and 20), a finer one would run for hours and gain nothing.
MAX_SEARCH_GRID = 1000


def grid_problem(grid: object, key: str = "mse_grid") -> str | None:
    """Why ``grid`` is no search grid (an int in ``[1, MAX_SEARCH_GRID]``), or None."""
    if isinstance(grid, bool) or not isinstance(grid, int) or not 0 < grid <= MAX_SEARCH_GRID:
        return f"{key} must be an int between 1 and {MAX_SEARCH_GRID}, got {grid!r}"
    return None


def mse_option_problems(grid: object, maxshrink: object, norm: object) -> list[str]:
    """What is wrong with a set of search options (empty when they are valid)."""
    problems = []
    problem = grid_problem(grid)
    if problem is not None:
        problems.append(problem)
    if (
        isinstance(maxshrink, bool)
        or not isinstance(maxshrink, (int, float))
        or not 0 < maxshrink < 1
    ):
        problems.append(f"mse_maxshrink must be a number in (0, 1), got {maxshrink!r}")
    if (
        isinstance(norm, bool)
        or not isinstance(norm, (int, float))
        or not math.isfinite(norm)
        or not norm > 0
    ):
        problems.append(f"mse_norm must be a finite number > 0, got {norm!r}")
    return problems


def shrink_factors(grid: int, maxshrink: float) -> list[float]:
    """The range factors tried, largest first: ``1 - i / grid`` for ``i = 0 .. floor(maxshrink * grid)``.

    A grid coarser than ``maxshrink`` (``grid * maxshrink < 1``) leaves only ``p = 1``.

    :raises ValueError: for a grid outside ``[1, MAX_SEARCH_GRID]``.
    """
    problem = grid_problem(grid, "grid")
    if problem is not None:
        raise ValueError(problem)
    # The small slack keeps e.g. 0.2 * 100 (which float arithmetic may put just under 20) at 20.
    steps = math.floor(maxshrink * grid + 1e-9)
    return [1.0 - i / grid for i in range(steps + 1)]


@dataclass(frozen=True)
class MSEOptions:
    """Options of the MSE clipping search (the YAML ``ext`` keys ``mse_grid``, ``mse_maxshrink``,
    ``mse_norm``); an instance means "search on", ``None`` where one is expected means "plain min/max".

    :param grid: the range shrinks in steps of ``1 / grid``.
    :param maxshrink: the largest fraction of the range that may be cut (``0 < maxshrink < 1``).
    :param norm: exponent of the error measured: ``sum |w - w_q|^norm``.
    :raises ValueError: for invalid values.
    """

    grid: int = 100
    maxshrink: float = 0.2
    norm: float = 2.4
    #: The finest grid accepted (:data:`MAX_SEARCH_GRID`), for configs to bound theirs with.
    max_grid: ClassVar[int] = MAX_SEARCH_GRID

    def __post_init__(self) -> None:
        problems = mse_option_problems(self.grid, self.maxshrink, self.norm)
        if problems:
            raise ValueError("invalid MSE clipping options: " + "; ".join(problems))

    @classmethod
    def from_flags(
        cls, mse: bool, grid: int = 100, maxshrink: float = 0.2, norm: float = 2.4
    ) -> MSEOptions | None:
        """Options from the flat YAML fields: ``None`` when ``mse`` is off."""
        return cls(grid, float(maxshrink), float(norm)) if mse else None


def mse_qparams(
    values: torch.Tensor,
    bits: int,
    symmetric: bool,
    *,
    dim: int = -1,
    grid: int = 100,
    maxshrink: float = 0.2,
    norm: float = 2.4,
    full_range: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and signed offset of every slice along ``dim``, with the range shrunk to minimise error.

    :param values: any floating tensor; each slice along ``dim`` (a row, or a row-group) gets its
        own parameters. Computed in float32 whatever the dtype.
    :param dim: the dimension reduced over (the elements sharing one scale).
    :returns: ``(scale, offset)``, float32, shaped like ``values`` without ``dim``.
    """
    qmin, qmax = qrange(bits)
    dim = dim % values.dim()
    # 1. Observed range of every slice, in float32 (the plain min/max candidate is p = 1).
    values = values.detach().float()
    low, high = values.amin(dim), values.amax(dim)
    best_scale, best_offset = compute_qparams(low, high, bits, symmetric, full_range)
    best_err: torch.Tensor | None = None
    fake = torch.empty_like(values)
    for p in shrink_factors(grid, maxshrink):
        # 2. Candidate parameters from the shrunken range [p * min, p * max].
        if p == 1.0:
            scale, offset = best_scale, best_offset
        else:
            scale, offset = compute_qparams(low * p, high * p, bits, symmetric, full_range)
        scale_b, offset_b = scale.unsqueeze(dim), offset.unsqueeze(dim)
        # 3. Fake-quantize exactly as the quantizer does: (clamp(round(w / s + o)) - o) * s.
        torch.div(values, scale_b, out=fake)
        if not symmetric:
            fake.add_(offset_b)
        fake.round_().clamp_(qmin, qmax)
        if not symmetric:
            fake.sub_(offset_b)
        fake.mul_(scale_b)
        # 4. Error of every slice: sum |w - w_q|^norm.
        err = fake.sub_(values).abs_().pow_(norm).sum(dim)
        # 5. Keep strictly better candidates only, so ties keep the larger range.
        if best_err is None:
            best_err = err
            continue
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_scale = torch.where(better, scale, best_scale)
        best_offset = torch.where(better, offset, best_offset)
    return best_scale, best_offset


def mse_minmax_qparams(
    weight: torch.Tensor,
    bits: int,
    symmetric: bool,
    group_size: int | None,
    options: MSEOptions,
    full_range: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel or per-group parameters of a 2-D weight, MSE-searched (cf. ``minmax_qparams``).

    :returns: ``(scale, offset)`` float32 tensors of shape ``[out, in // group_size]``
        (``[out, 1]`` when ``group_size`` is None).
    """
    out_features, in_features = weight.shape
    width = in_features if group_size is None else group_size
    # 1. One slice per row and group: [out, groups, width], searched over the last dimension.
    grouped = weight.reshape(out_features, in_features // width, width)
    return mse_qparams(
        grouped,
        bits,
        symmetric,
        dim=-1,
        grid=options.grid,
        maxshrink=options.maxshrink,
        norm=options.norm,
        full_range=full_range,
    )


def range_qparams(
    values: torch.Tensor,
    bits: int,
    symmetric: bool,
    mse: MSEOptions | None,
    dim: int = -1,
    full_range: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Parameters of every slice along ``dim``: plain min/max when ``mse`` is None, else searched.

    The plain branch is exactly ``compute_qparams(values.amin(dim), values.amax(dim), ...)``.
    """
    if mse is None:
        return compute_qparams(values.amin(dim), values.amax(dim), bits, symmetric, full_range)
    return mse_qparams(
        values,
        bits,
        symmetric,
        dim=dim,
        grid=mse.grid,
        maxshrink=mse.maxshrink,
        norm=mse.norm,
        full_range=full_range,
    )


def weight_qparams(
    weight: torch.Tensor,
    bits: int,
    symmetric: bool,
    group_size: int | None,
    mse: MSEOptions | None,
    full_range: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest parameters of a 2-D weight: ``minmax_qparams`` or the MSE search."""
    if mse is None:
        return minmax_qparams(weight, bits, symmetric, group_size, full_range)
    return mse_minmax_qparams(weight, bits, symmetric, group_size, mse, full_range)
