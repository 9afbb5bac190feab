"""Public GPTQ quantizers: :class:`WeightPerChannelGPTQ` and :class:`WeightPerGroupGPTQ`.

Each one accumulates its layer's Hessian from calibration activations (:meth:`add_batch`) and then
quantizes the layer's weight (:meth:`quantize`) with msModelSlim's GPTQ numerics; the solve itself is
:func:`msquant.quant.gptq_solver.gptq_quantize`. Fields mirror ``qconfig.weight`` (+ ``ext``) of
msModelSlim's ``method: gptq``, plus ``desc_act``, ``static_groups``, the damping retry options and
the optional MSE clipping search for scales (``mse``, ``mse_grid``, ``mse_maxshrink``, ``mse_norm``).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import torch

from msquant.backends.base import Backend
from msquant.errors import QuantizationError
from msquant.quant.gptq_solver import GPTQResult, gptq_quantize
from msquant.quant.hessian import HessianAccumulator
from msquant.quant.mse_clip import MSEOptions, mse_option_problems

__all__ = [
    "GPTQResult",
    "WeightPerChannelGPTQ",
    "WeightPerGroupGPTQ",
    "HessianAccumulator",
    "gptq_quantize",
    "GPTQ_EXT_DEFAULTS",
]

#: ``ext`` keys understood by the GPTQ classes and the classes' defaults (msModelSlim's numerics:
#: the classes are the building blocks; ``linear_quant`` passes every option it resolved from the
#: YAML's :class:`~msquant.quant.methods.GPTQExt`, whose defaults follow ``ext.numerics``).
GPTQ_EXT_DEFAULTS: Mapping[str, Any] = MappingProxyType(
    {
        "percdamp": 0.01,
        "block_size": 128,
        "group_size": 128,
        "desc_act": False,
        "static_groups": False,
        "damp_auto_increment": 0.01,
        "max_damp_retries": 10,
        "mse": False,
        "mse_grid": 100,
        "mse_maxshrink": 0.2,
        "mse_norm": 2.4,
        "full_range": False,
    }
)

#: ``ext`` keys that only make sense with groups (ignored or refused per-channel).
_GROUP_ONLY_KEYS = ("group_size", "static_groups")


def _check_options(
    name: str,
    bits: int,
    percdamp: float,
    block_size: int,
    damp_auto_increment: float,
    max_damp_retries: int,
    group_size: int | None,
    mse: bool,
    mse_grid: int,
    mse_maxshrink: float,
    mse_norm: float,
) -> None:
    """Reject option values that cannot work, naming the layer and the valid range."""
    problems = []
    if isinstance(bits, bool) or not isinstance(bits, int) or not 2 <= bits <= 8:
        problems.append(f"bits must be an int between 2 and 8, got {bits!r}")
    if isinstance(percdamp, bool) or not isinstance(percdamp, (int, float)) or not percdamp > 0:
        problems.append(f"percdamp must be a number > 0, got {percdamp!r}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        problems.append(f"block_size must be an int > 0, got {block_size!r}")
    if (
        isinstance(damp_auto_increment, bool)
        or not isinstance(damp_auto_increment, (int, float))
        or not damp_auto_increment > 0
    ):
        problems.append(f"damp_auto_increment must be a number > 0, got {damp_auto_increment!r}")
    if (
        isinstance(max_damp_retries, bool)
        or not isinstance(max_damp_retries, int)
        or max_damp_retries < 0
    ):
        problems.append(f"max_damp_retries must be an int >= 0, got {max_damp_retries!r}")
    if group_size is not None and (
        isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0
    ):
        problems.append(f"group_size must be an int > 0, got {group_size!r}")
    if not isinstance(mse, bool):
        problems.append(f"mse must be a bool, got {mse!r}")
    problems += mse_option_problems(mse_grid, mse_maxshrink, mse_norm)
    if problems:
        raise QuantizationError(f"{name}: invalid GPTQ options: " + "; ".join(problems))


class _GPTQ:
    """Shared state and API of the per-channel and per-group GPTQ quantizers.

    ``accumulator`` (a :class:`HessianAccumulator`) holds the layer's ``X^T X`` and token count;
    :meth:`quantize` solves from it without copying it, and may be called more than once.
    """

    group_size: int | None = None
    static_groups: bool = False

    def __init__(
        self,
        bits: int,
        symmetric: bool,
        percdamp: float,
        block_size: int,
        desc_act: bool,
        damp_auto_increment: float,
        max_damp_retries: int,
        name: str,
        in_features: int | None,
        mse: bool,
        mse_grid: int,
        mse_maxshrink: float,
        mse_norm: float,
        full_range: bool = False,
    ) -> None:
        _check_options(
            name, bits, percdamp, block_size, damp_auto_increment, max_damp_retries,
            self.group_size, mse, mse_grid, mse_maxshrink, mse_norm,
        )  # fmt: skip
        self.bits = bits
        self.symmetric = bool(symmetric)
        self.percdamp = float(percdamp)
        self.block_size = block_size
        self.desc_act = bool(desc_act)
        self.damp_auto_increment = float(damp_auto_increment)
        self.max_damp_retries = max_damp_retries
        self.mse = mse
        self.mse_grid = mse_grid
        self.mse_maxshrink = float(mse_maxshrink)
        self.mse_norm = float(mse_norm)
        self.full_range = bool(full_range)
        self.name = name
        self.accumulator = HessianAccumulator(in_features, name=name)

    @classmethod
    def _ext_kwargs(
        cls, ext: Mapping[str, Any], allowed: tuple[str, ...], name: str
    ) -> dict[str, Any]:
        unknown = sorted(set(ext) - set(allowed))
        if unknown:
            raise QuantizationError(
                f"{name}: unknown GPTQ ext option(s) {unknown}; valid: {', '.join(allowed)}"
            )
        return {key: value for key, value in ext.items() if value is not None}

    @property
    def mse_options(self) -> MSEOptions | None:
        """The MSE clipping search options, or None when ``mse`` is off (plain min/max scales)."""
        return MSEOptions.from_flags(self.mse, self.mse_grid, self.mse_maxshrink, self.mse_norm)

    @property
    def nsamples(self) -> int:
        """Calibration tokens accumulated so far (padding excluded)."""
        return self.accumulator.n

    def add_batch(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> None:
        """Accumulate the Hessian from one batch of layer inputs ``[..., in_features]``.

        :param attention_mask: optional, shaped like ``x.shape[:-1]``; zeros mark padding tokens.
        """
        self.accumulator.add_batch(x, attention_mask)

    def free(self) -> None:
        """Drop the accumulated Hessian (memory is released; ``add_batch`` starts over)."""
        self.accumulator.free()

    def quantize(self, weight: torch.Tensor, backend: Backend | None = None) -> GPTQResult:
        """Quantize ``weight`` (``[out, in]``, any floating dtype) with the accumulated Hessian.

        :param backend: runs the Cholesky and triangular solves (``CpuBackend`` when None).
        :raises QuantizationError: no batch was accumulated, shapes disagree, or the checks of
            :func:`gptq_quantize` fail.
        """
        raw, count = self.accumulator.raw_sum()
        return gptq_quantize(
            weight,
            raw,
            bits=self.bits,
            symmetric=self.symmetric,
            group_size=self.group_size,
            percdamp=self.percdamp,
            block_size=self.block_size,
            desc_act=self.desc_act,
            static_groups=self.static_groups,
            damp_auto_increment=self.damp_auto_increment,
            max_damp_retries=self.max_damp_retries,
            name=self.name,
            backend=backend,
            hessian_scale=2.0 / count,
            nsamples=count,
            mse=self.mse_options,
            full_range=self.full_range,
        )

    def __repr__(self) -> str:
        group = "" if self.group_size is None else f", group_size={self.group_size}"
        mse = "" if not self.mse else f", mse={self.mse_options}"
        mse += ", full_range=True" if self.full_range else ""
        return (
            f"{type(self).__name__}(name={self.name!r}, bits={self.bits}, symmetric={self.symmetric}"
            f"{group}, percdamp={self.percdamp}, block_size={self.block_size}, desc_act={self.desc_act}"
            f"{mse})"
        )


class WeightPerChannelGPTQ(_GPTQ):
    """GPTQ with one scale/offset per output channel (``scale`` and ``offset`` ``[out, 1]``).

    Fields mirror ``qconfig.weight`` + ``ext`` of msModelSlim's ``method: gptq``.

    :param bits: code width (8 for int8, 4 for int4; 2..8 accepted).
    :param symmetric: zero offset (True) or signed zero point (False).
    :param percdamp: damping as a fraction of the mean Hessian diagonal.
    :param block_size: lazy-batch width over input columns (clipped to in_features; the last block
        may be shorter).
    :param desc_act: act-order (descending Hessian diagonal).
    :param damp_auto_increment: added to ``percdamp`` after each failed Cholesky.
    :param max_damp_retries: how many increases are tried before giving up.
    :param mse: search each scale by shrinking the min/max range to minimise
        ``sum |w - w_q|^mse_norm`` (:mod:`msquant.quant.mse_clip`); off by default (msModelSlim).
    :param mse_grid: the range shrinks in steps of ``1 / mse_grid``.
    :param mse_maxshrink: the largest fraction of the range that may be cut (in (0, 1)).
    :param mse_norm: exponent of the error the search minimises.
    :param full_range: symmetric scales ``max|w| / (2^(b-1) - 0.5)`` using the code ``-2^(b-1)``
        (GPTQModel / llm-compressor) instead of msModelSlim's ``/ (2^(b-1) - 1)``; off by default.
    :param name: module name for messages.
    :param in_features: expected input width (taken from the first batch when None).
    """

    def __init__(
        self,
        bits: int = 8,
        symmetric: bool = True,
        percdamp: float = 0.01,
        block_size: int = 128,
        desc_act: bool = False,
        damp_auto_increment: float = 0.01,
        max_damp_retries: int = 10,
        mse: bool = False,
        mse_grid: int = 100,
        mse_maxshrink: float = 0.2,
        mse_norm: float = 2.4,
        full_range: bool = False,
        name: str = "layer",
        in_features: int | None = None,
    ) -> None:
        super().__init__(
            bits=bits,
            symmetric=symmetric,
            percdamp=percdamp,
            block_size=block_size,
            desc_act=desc_act,
            damp_auto_increment=damp_auto_increment,
            max_damp_retries=max_damp_retries,
            name=name,
            in_features=in_features,
            mse=mse,
            mse_grid=mse_grid,
            mse_maxshrink=mse_maxshrink,
            mse_norm=mse_norm,
            full_range=full_range,
        )

    @classmethod
    def from_ext(
        cls, bits: int, symmetric: bool, ext: Mapping[str, Any], name: str = "layer"
    ) -> WeightPerChannelGPTQ:
        """Build from a YAML ``ext`` mapping (``group_size`` is ignored per-channel; None = default)."""
        allowed = tuple(key for key in GPTQ_EXT_DEFAULTS if key not in _GROUP_ONLY_KEYS)
        kwargs = cls._ext_kwargs({k: v for k, v in ext.items() if k != "group_size"}, allowed, name)
        return cls(bits=bits, symmetric=symmetric, name=name, **kwargs)


class WeightPerGroupGPTQ(_GPTQ):
    """GPTQ with one scale/offset per output channel and group of ``group_size`` input columns.

    Parameters as :class:`WeightPerChannelGPTQ`, plus:

    :param group_size: input columns per group (must divide in_features).
    :param static_groups: fix every group's parameters from the original weight before the sweep
        (default False: recomputed at each group start from the running weight, as msModelSlim).
        Forced on with ``desc_act`` so the group index stays trivial (``g_idx[i] = i // group_size``).
    """

    def __init__(
        self,
        bits: int = 8,
        symmetric: bool = True,
        percdamp: float = 0.01,
        block_size: int = 128,
        group_size: int = 128,
        static_groups: bool = False,
        desc_act: bool = False,
        damp_auto_increment: float = 0.01,
        max_damp_retries: int = 10,
        mse: bool = False,
        mse_grid: int = 100,
        mse_maxshrink: float = 0.2,
        mse_norm: float = 2.4,
        full_range: bool = False,
        name: str = "layer",
        in_features: int | None = None,
    ) -> None:
        self.group_size = group_size
        self.static_groups = bool(static_groups)
        super().__init__(
            bits=bits,
            symmetric=symmetric,
            percdamp=percdamp,
            block_size=block_size,
            desc_act=desc_act,
            damp_auto_increment=damp_auto_increment,
            max_damp_retries=max_damp_retries,
            name=name,
            in_features=in_features,
            mse=mse,
            mse_grid=mse_grid,
            mse_maxshrink=mse_maxshrink,
            mse_norm=mse_norm,
            full_range=full_range,
        )

    @classmethod
    def from_ext(
        cls, bits: int, symmetric: bool, ext: Mapping[str, Any], name: str = "layer"
    ) -> WeightPerGroupGPTQ:
        """Build from a YAML ``ext`` mapping (keys of :data:`GPTQ_EXT_DEFAULTS`; None = default)."""
        kwargs = cls._ext_kwargs(ext, tuple(GPTQ_EXT_DEFAULTS), name)
        return cls(bits=bits, symmetric=symmetric, name=name, **kwargs)
