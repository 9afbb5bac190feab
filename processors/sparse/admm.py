"""The numerics of ``float_sparse``: ADMM pruning of one linear weight against its inputs'
Hessian, then the rounding of the kept weights that msModelSlim 26.1.0 applies (W16A16S).

Definition (msModelSlim 26.1.0, ``processor/sparse/admm.py``; re-implemented, outputs compared
in ``tests/oracle/test_msmodelslim_sparse.py``):

* statistics of the inputs ``X`` (``[tokens, in]``, float32): ``H = sum X^T X`` and, per input
  column, the mean over samples of each sample's sum of squares (``column_energy``);
* ADMM on the normalized problem: ``d = sqrt(diag H) + 1e-8``, ``Hn = H / d d^T``,
  ``Wn = (W * d)^T``; ``Hn += 0.1 * mean(diag Hn) * I`` (damping), ``B = Hn Wn``,
  ``Hn += rho * I`` with ``rho = 1``; then 20 iterations of
  ``Z = (Wn + U) * M``, ``U += Wn - Z``, ``Wn = Hn^-1 (B + rho (Z - U))``, where the mask ``M``
  zeroes the ``int(ratio * numel)`` entries of smallest ``|Wn + U|`` over the whole tensor,
  chosen again in each of the first 15 iterations and kept after; the weight is
  ``((Wn + U) * M)^T / d``, in the model's dtype;
* rounding (:func:`round_mantissa`): every weight goes to float16 and keeps two mantissa bits
  (round to nearest even), except the 2 % whose rounding error, times
  ``sqrt(column_energy)``, is largest, which keep their float16 value; float16 subnormals
  become 0, magnitudes in ``[2^-14, 2^-8)`` become ``2^e`` (or ``2^(e+1)`` above ``1.5 * 2^e``).

So the weight has at least ``int(ratio * numel)`` zeros (the rounding adds the subnormals);
every step is in float32 (the inverse on the CPU, as msModelSlim computes it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = [
    "DAMP",
    "ITERATIONS",
    "KEEP_FRACTION",
    "MANTISSA_BITS",
    "MASK_ITERATIONS",
    "InputStats",
    "admm_prune",
    "keep_mask",
    "pruned_count",
    "round_mantissa",
    "sparsify",
]

DAMP = 0.1  # damping, relative to the normalized Hessian's mean diagonal
RHO = 1.0  # ADMM penalty
ITERATIONS = 20
MASK_ITERATIONS = 15  # the mask is chosen again in each of the first iterations, then kept
KEEP_FRACTION = 0.02  # share of weights that keep their float16 value
MANTISSA_BITS = 2  # mantissa bits of the other weights
_NORM_EPS = 1e-8
_MIN_EXP = -14  # float16's smallest normal exponent


@dataclass
class InputStats:
    """What pruning needs of one linear's calibration inputs, gathered batch by batch.

    :param hessian: ``sum X^T X`` over every token, float32 ``[in, in]``.
    :param column_energy: per input column, the mean over samples of the sample's sum of
        squares (float32 ``[in]``); ranks which weights keep their float16 value.
    :param samples: samples seen (the leading dimension of each 3-d batch).
    """

    in_features: int
    device: torch.device | str = "cpu"
    hessian: torch.Tensor = field(init=False)
    column_energy: torch.Tensor = field(init=False)
    samples: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.hessian = torch.zeros(self.in_features, self.in_features, device=self.device)
        self.column_energy = torch.zeros(self.in_features, device=self.device)

    def add(self, x: torch.Tensor) -> None:
        """Accumulate one batch of inputs ``[..., in]`` (a 2-d batch counts as one sample)."""
        flat = x.reshape(-1, x.shape[-1]).float()
        self.hessian += flat.T.matmul(flat)
        count = x.shape[0] if x.dim() > 2 else 1
        self.column_energy *= self.samples / (self.samples + count)
        self.samples += count
        self.column_energy += torch.norm(flat.t(), p=2, dim=1) ** 2 / self.samples


def pruned_count(numel: int, ratio: float) -> int:
    """How many weights the ADMM mask zeroes: ``int(ratio * numel)`` over the whole tensor."""
    return int(numel * ratio)


def _mask(values: torch.Tensor, ratio: float) -> torch.Tensor:
    """True where kept: all but the ``pruned_count`` entries of smallest ``|values|``."""
    drop = torch.topk(values.abs().flatten(), k=pruned_count(values.numel(), ratio), largest=False)
    keep = torch.ones(values.numel(), dtype=torch.bool, device=values.device)
    keep[drop.indices] = False
    return keep.reshape(values.shape)


@torch.no_grad()
def admm_prune(weight: torch.Tensor, hessian: torch.Tensor, ratio: float) -> torch.Tensor:
    """The ADMM-pruned weight (float32 ``[out, in]``) of ``weight`` given its inputs' Hessian.

    :param weight: ``[out, in]``, any float dtype.
    :param hessian: ``sum X^T X`` of its inputs, float32 ``[in, in]``.
    :param ratio: the share of weights set to zero, in ``[0, 1]``.
    """
    scale = torch.diag(hessian).sqrt() + _NORM_EPS
    h = ((hessian / scale).T / scale).T
    w = (weight.float() * scale).T
    diagonal = torch.arange(h.shape[0], device=h.device)
    h[diagonal, diagonal] += DAMP * torch.diag(h).mean()
    target = h.matmul(w)
    h[diagonal, diagonal] += RHO
    h_inv = torch.inverse(h.cpu()).to(h.device)
    dual = torch.zeros_like(w)
    mask = torch.ones_like(w, dtype=torch.bool)
    for iteration in range(ITERATIONS):
        if iteration < MASK_ITERATIONS:
            mask = _mask(w + dual, ratio)
        sparse = (w + dual) * mask
        dual = dual + (w - sparse)
        w = h_inv.matmul(target + RHO * (sparse - dual))
    return ((w + dual) * mask).T / scale


def _split(half: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(|m|, e)`` with ``half = ±m * 2^e``: ``m`` in ``[1, 2)`` for normal numbers; for
    subnormals ``e = -15`` and ``m = half * 2^15``; for zero ``m = 0, e = 0``."""
    mantissa, exponent = half.frexp()
    exponent = exponent - 1
    mantissa = mantissa * 2
    subnormal = exponent < _MIN_EXP
    exponent[subnormal] = _MIN_EXP - 1
    exponent[half.isinf()] = 16
    exponent[half == 0] = 0
    mantissa[subnormal] = (half * 2**15)[subnormal]
    return mantissa.abs(), exponent


def round_mantissa(weight: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """``weight`` in float16 with :data:`MANTISSA_BITS` mantissa bits (module docstring), the
    entries of ``keep`` left at their float16 value."""
    half = weight.to(torch.float16)
    mantissa, exponent = _split(half)
    step = torch.full_like(exponent, MANTISSA_BITS)
    rounded = mantissa.clone()
    torch.ldexp(rounded, step, out=rounded)
    rounded = rounded.round().to(torch.float16)
    torch.ldexp(rounded, -step, out=rounded)
    rounded[exponent < _MIN_EXP] = 0.0
    if keep is not None:
        rounded[keep] = mantissa[keep]
    coarse = (exponent >= _MIN_EXP) & (exponent < MANTISSA_BITS - 10)
    rounded[coarse] = 1.0
    rounded[coarse & (mantissa > 1.5)] = 2.0
    result = torch.ldexp(rounded, exponent).to(torch.float16)
    return result * half.sign()


def keep_mask(weight: torch.Tensor, column_energy: torch.Tensor) -> torch.Tensor:
    """True for the :data:`KEEP_FRACTION` of ``weight`` whose mantissa rounding costs most,
    weighed by ``sqrt(column_energy)`` of their input column (ties at the threshold all kept)."""
    cost = (weight - round_mantissa(weight)).abs() * column_energy.reshape(1, -1).sqrt()
    ranked = cost.flatten().sort(descending=True)[0]
    threshold = ranked[int(cost.numel() * KEEP_FRACTION - 1)]
    return cost >= threshold


def sparsify(weight: torch.Tensor, stats: InputStats, ratio: float) -> torch.Tensor:
    """The W16A16S weight of a linear: :func:`admm_prune`, then :func:`round_mantissa` keeping
    :func:`keep_mask`; in ``weight``'s dtype and shape."""
    pruned = admm_prune(weight, stats.hessian, ratio).reshape(weight.shape)
    pruned = pruned.to(weight.dtype).contiguous()
    keep = keep_mask(pruned, stats.column_energy)
    return round_mantissa(pruned, keep).to(weight.dtype)
