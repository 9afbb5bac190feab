"""The options of one GPTQ solve, as one frozen value (:class:`GPTQOptions`).

The same object travels from the YAML (``linear_quant``'s typed ``ext`` resolves into it per
module) through the quantizer (:class:`~msquant.quant.gptq.GPTQQuantizer`) to the solver
(:func:`~msquant.quant.gptq_solver.gptq_quantize`).

One options path: the dataclass's fields are GPTQ's options and their defaults (with
:class:`~msquant.quant.mse_clip.MSEOptions`' for the MSE search, and
:attr:`GPTQOptions.ext_group_size`); :data:`GPTQ_EXT_DEFAULTS` and the ``gptq`` method's YAML
schema take their defaults from here. :meth:`GPTQOptions.from_ext` is the one constructor from an
``ext`` mapping (the ``gptq`` method builds each module's options with it, msModelSlim's class
names too), checking values with :meth:`GPTQOptions.from_flat`; the solver only checks what
depends on the weight (shapes, block size).

Per-channel is ``group_size=None`` here and everywhere in :mod:`msquant.quant`; GPTQModel's ``-1``
exists only in the ``dynamic`` rules' YAML and in what is written for the engines.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any, ClassVar

from msquant.errors import QuantizationError
from msquant.quant.mse_clip import MSEOptions, mse_option_problems

__all__ = ["GPTQOptions", "GPTQ_EXT_DEFAULTS"]


@dataclass(frozen=True)
class GPTQOptions:
    """Everything a GPTQ solve needs besides the weight and its Hessian.

    :param bits: code width (2..8).
    :param symmetric: zero offset (True) or signed zero point (False).
    :param group_size: input columns per group; None for one scale per output channel.
    :param percdamp: damping as a fraction of the mean Hessian diagonal.
    :param block_size: lazy-batch width over input columns (clipped to in_features).
    :param desc_act: act-order: columns by descending Hessian diagonal (forces static groups).
    :param static_groups: per-group parameters fixed from the original weight before the sweep.
    :param damp_auto_increment: added to ``percdamp`` after each failed Cholesky.
    :param max_damp_retries: how many damping increases are tried before giving up.
    :param mse: the MSE clipping search for scales; None for plain min/max (msModelSlim).
    :param full_range: symmetric scales ``max|w| / (2^(b-1) - 0.5)`` (GPTQModel / llm-compressor)
        instead of msModelSlim's ``/ (2^(b-1) - 1)``.
    """

    bits: int = 8
    symmetric: bool = True
    group_size: int | None = None
    percdamp: float = 0.01
    block_size: int = 128
    desc_act: bool = False
    static_groups: bool = False
    damp_auto_increment: float = 0.01
    max_damp_retries: int = 10
    mse: MSEOptions | None = None
    full_range: bool = False
    #: The most damping increases accepted (``max_damp_retries``): each one factorises the
    #: Hessian again; a Hessian that 100 increases (1 + 100 x 0.01 of its mean diagonal by
    #: default) cannot make positive definite is broken, not under-damped.
    max_retries: ClassVar[int] = 100
    #: ``ext.group_size`` of a per-group entry that sets none (msModelSlim's 128); the dataclass's
    #: own ``group_size`` default, None, is per-channel.
    ext_group_size: ClassVar[int] = 128

    @classmethod
    def from_flat(cls, name: str = "layer", **values: Any) -> GPTQOptions:
        """Options from loose keywords named as the YAML ``ext`` keys (``mse`` a bool, with
        ``mse_grid``, ``mse_maxshrink``, ``mse_norm``), validated with messages naming ``name``.

        :raises QuantizationError: ``<name>: invalid GPTQ options: ...`` listing every problem.
        :raises TypeError: for a keyword that is no option.
        """
        mse = values.pop("mse", GPTQ_EXT_DEFAULTS["mse"])
        grid = values.pop("mse_grid", GPTQ_EXT_DEFAULTS["mse_grid"])
        maxshrink = values.pop("mse_maxshrink", GPTQ_EXT_DEFAULTS["mse_maxshrink"])
        norm = values.pop("mse_norm", GPTQ_EXT_DEFAULTS["mse_norm"])
        options = cls(**values)
        problems = options.problems()
        if not isinstance(mse, bool):
            problems.append(f"mse must be a bool, got {mse!r}")
        problems += mse_option_problems(grid, maxshrink, norm)
        if problems:
            raise QuantizationError(f"{name}: invalid GPTQ options: " + "; ".join(problems))
        return replace(options, mse=MSEOptions.from_flags(mse, grid, maxshrink, norm))

    @classmethod
    def from_ext(
        cls,
        bits: int,
        symmetric: bool,
        ext: Mapping[str, Any],
        name: str = "layer",
        per_group: bool = True,
    ) -> GPTQOptions:
        """Options from a YAML-style ``ext`` mapping (keys of :data:`GPTQ_EXT_DEFAULTS`; a None
        value takes the default). Per-channel (``per_group=False``) ignores ``group_size`` and
        refuses ``static_groups``.

        :raises QuantizationError: an unknown key (listing the valid ones) or an invalid value.
        """
        allowed = tuple(GPTQ_EXT_DEFAULTS) if per_group else PER_CHANNEL_KEYS
        given = {k: v for k, v in ext.items() if per_group or k != "group_size"}
        unknown = sorted(set(given) - set(allowed))
        if unknown:
            raise QuantizationError(
                f"{name}: unknown GPTQ ext option(s) {unknown}; valid: {', '.join(allowed)}"
            )
        values = {key: value for key, value in given.items() if value is not None}
        if per_group:
            values.setdefault("group_size", GPTQ_EXT_DEFAULTS["group_size"])
        return cls.from_flat(name, bits=bits, symmetric=symmetric, **values)

    def problems(self) -> list[str]:
        """What is wrong with these values (empty when they are valid); the MSE options check
        themselves when built."""
        problems = []
        if not _is_int(self.bits) or not 2 <= self.bits <= 8:
            problems.append(f"bits must be an int between 2 and 8, got {self.bits!r}")
        if not _is_number(self.percdamp) or not self.percdamp > 0:
            problems.append(f"percdamp must be a number > 0, got {self.percdamp!r}")
        if not _is_int(self.block_size) or self.block_size <= 0:
            problems.append(f"block_size must be an int > 0, got {self.block_size!r}")
        if not _is_number(self.damp_auto_increment) or not self.damp_auto_increment > 0:
            problems.append(
                f"damp_auto_increment must be a number > 0, got {self.damp_auto_increment!r}"
            )
        if not _is_int(self.max_damp_retries) or not 0 <= self.max_damp_retries <= self.max_retries:
            problems.append(
                f"max_damp_retries must be an int between 0 and {self.max_retries}, got "
                f"{self.max_damp_retries!r}"
            )
        if self.group_size is not None and (not _is_int(self.group_size) or self.group_size <= 0):
            problems.append(f"group_size must be an int > 0, got {self.group_size!r}")
        return problems

    @property
    def static(self) -> bool:
        """Whether group parameters are fixed before the sweep (static groups, or act-order)."""
        return self.group_size is not None and (self.static_groups or self.desc_act)


def _ext_defaults() -> Mapping[str, Any]:
    """The ``ext`` keys with their defaults, read from the dataclasses (no second table)."""
    solver, search = GPTQOptions(), MSEOptions()
    flat = {
        "group_size": GPTQOptions.ext_group_size,
        "mse": False,
        "mse_grid": search.grid,
        "mse_maxshrink": search.maxshrink,
        "mse_norm": search.norm,
    }
    return MappingProxyType(
        {key: flat[key] if key in flat else getattr(solver, key) for key in EXT_KEYS}
    )


#: The YAML-style ``ext`` keys :meth:`GPTQOptions.from_ext` understands, in the order messages
#: list them.
EXT_KEYS = (
    "percdamp",
    "block_size",
    "group_size",
    "desc_act",
    "static_groups",
    "damp_auto_increment",
    "max_damp_retries",
    "mse",
    "mse_grid",
    "mse_maxshrink",
    "mse_norm",
    "full_range",
)
#: :data:`EXT_KEYS` with their defaults, those of :class:`GPTQOptions` (msModelSlim's numerics;
#: ``linear_quant``'s defaults follow ``ext.numerics`` instead).
GPTQ_EXT_DEFAULTS: Mapping[str, Any] = _ext_defaults()
#: The keys that mean something per-channel (no groups).
PER_CHANNEL_KEYS = tuple(k for k in EXT_KEYS if k not in ("group_size", "static_groups"))


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
