"""Weight quantization methods known to ``linear_quant`` and the option schema (``ext``) of each.

This table is what decides, before any model is loaded, whether a ``(dtype, scope, method)``
combination is implemented and whether its ``ext`` options are valid.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator

from msquant.model.moe import DEFAULT_EXPERT_TOKEN_RATIO
from msquant.quant.mse_clip import MSEOptions
from msquant.quant.qconfig import QDType, QScope

__all__ = [
    "MinMaxExt",
    "GPTQExt",
    "GPTQDefaults",
    "GPTQ_NUMERICS",
    "GPTQNumerics",
    "CalibInputs",
    "WeightMethod",
    "WEIGHT_METHODS",
]

# The MSE clipping search options, shared by minmax and gptq (see msquant.quant.mse_clip).
MseFlag = Annotated[
    bool,
    Field(
        description="Search each row's (or group's) scale by shrinking its min/max range to "
        "minimise sum |w - w_q|^mse_norm, instead of plain min/max (off: msModelSlim's numerics)."
    ),
]
MseGrid = Annotated[
    StrictInt, Field(gt=0, description="MSE search: the range shrinks in steps of 1 / mse_grid.")
]
MseMaxShrink = Annotated[
    float,
    Field(
        gt=0,
        lt=1,
        allow_inf_nan=False,
        description="MSE search: the largest fraction of the range that may be cut.",
    ),
]
MseNorm = Annotated[
    float,
    Field(
        gt=0,
        allow_inf_nan=False,
        description="MSE search: exponent of the error measured, sum |w - w_q|^mse_norm.",
    ),
]
FullRange = Annotated[
    bool,
    Field(
        description="Symmetric only: scale = max|w| / (2^(b-1) - 0.5), using the code -2^(b-1) "
        "(GPTQModel's and llm-compressor's convention: a 7 % finer step at int4, 0.4 % at int8) "
        "instead of msModelSlim's max|w| / (2^(b-1) - 1). Pays off at int4; at int8 with small "
        "groups it can cost more than it saves. Default false: msModelSlim's numerics."
    ),
]


class MinMaxExt(BaseModel):
    """``ext`` options of ``method: minmax`` (round-to-nearest)."""

    model_config = ConfigDict(extra="forbid")

    group_size: StrictInt = Field(
        128, gt=0, description="Input columns per group (per_group only)."
    )
    mse: MseFlag = False
    mse_grid: MseGrid = 100
    mse_maxshrink: MseMaxShrink = 0.2
    mse_norm: MseNorm = 2.4
    full_range: FullRange = False
    expert_min_tokens: float = Field(
        DEFAULT_EXPERT_TOKEN_RATIO,
        ge=0,
        description="MoE experts whose Hessian got fewer calibration tokens than this times their "
        "in_features are rounded to nearest instead of solved by GPTQ (listed in the run report).",
    )

    def mse_options(self) -> MSEOptions | None:
        """The MSE search options, or None when ``mse`` is off (plain min/max)."""
        return MSEOptions.from_flags(self.mse, self.mse_grid, self.mse_maxshrink, self.mse_norm)


GPTQNumerics = Literal["msquant", "msmodelslim"]
CalibInputs = Literal["quantized", "float"]


@dataclass(frozen=True)
class GPTQDefaults:
    """What ``ext.numerics`` makes the default of the GPTQ options a config leaves unset.

    :param desc_act: act-order (static groups: the group index stays trivial).
    :param full_range_max_bits: symmetric ``full_range`` grid for widths up to this many bits
        (0: never).
    :param calib_inputs: ``quantized``: each layer is calibrated on the outputs of the already
        quantized previous layers; ``float``: on the float model's activations.
    :param true_sequential: inside a layer, the linears of each submodule (attention, then MLP)
        are quantized before the next submodule's Hessians are gathered.
    :param mse_max_bits: the MSE clipping search for scales when ``qconfig``'s dtype has at most
        this many bits (0: never).
    """

    desc_act: bool
    full_range_max_bits: int
    calib_inputs: CalibInputs
    true_sequential: bool
    mse_max_bits: int


#: The defaults behind each ``ext.numerics`` value. ``msquant``'s were chosen by
#: ``bench/accuracy.py`` on SmolLM2-135M (docs/accuracy.md); ``msmodelslim`` reproduces
#: msModelSlim's GPTQ (no act-order, groups computed during the sweep, codes -7..7 at int4, float
#: activations) exactly.
GPTQ_NUMERICS: Mapping[str, GPTQDefaults] = MappingProxyType(
    {
        "msquant": GPTQDefaults(
            desc_act=True,
            full_range_max_bits=4,
            calib_inputs="quantized",
            true_sequential=False,
            mse_max_bits=4,
        ),
        "msmodelslim": GPTQDefaults(
            desc_act=False,
            full_range_max_bits=0,
            calib_inputs="float",
            true_sequential=False,
            mse_max_bits=0,
        ),
    }
)


class GPTQExt(BaseModel):
    """``ext`` options of ``method: gptq``: msModelSlim's (percdamp, block_size, group_size), plus
    the numerics switch, act-order, static groups, the grid, how layers are calibrated, the
    Cholesky retry policy and the MSE clipping search. Options left unset take the defaults of
    ``numerics``."""

    # The defaults are in GPTQ_NUMERICS; the resolved_* methods return the values a run uses.

    model_config = ConfigDict(extra="forbid")

    numerics: GPTQNumerics = Field(
        "msquant",
        description="Defaults of the options below that the config leaves unset. msquant: "
        "act-order with static groups, and at 4 bits and below the full_range grid and the MSE "
        "scale search, each layer calibrated on the quantized previous layers' outputs (chosen "
        "by measurement, see docs/accuracy.md). msmodelslim: msModelSlim's GPTQ numerics exactly (no act-order, "
        "group parameters computed during the sweep, codes -7..7 at int4, every layer calibrated "
        "on the float model's activations).",
    )
    percdamp: float = Field(
        0.01,
        gt=0,
        allow_inf_nan=False,
        description="Damping as a fraction of the mean Hessian diagonal.",
    )
    block_size: StrictInt = Field(
        128,
        gt=0,
        description="Lazy-batch width over input columns (the last block may be shorter).",
    )
    group_size: StrictInt = Field(
        128, gt=0, description="Input columns per group (per_group only)."
    )
    desc_act: bool | None = Field(
        None,
        description="Act-order: process columns by descending Hessian diagonal, with static "
        "groups (the group index stays trivial, as vLLM requires). Default from numerics "
        "(msquant: true; msmodelslim: false).",
    )
    static_groups: bool | None = Field(
        None,
        description="Fix group scales from the original weight before the sweep. Always on with "
        "desc_act (static_groups: false together with desc_act is refused); default off without.",
    )
    full_range: bool | None = Field(
        None,
        description="Symmetric only: scale = max|w| / (2^(b-1) - 0.5), using the code -2^(b-1) "
        "(GPTQModel's and llm-compressor's grid) instead of msModelSlim's max|w| / (2^(b-1) - 1). "
        "Default from numerics (msquant: on at 4 bits and below; msmodelslim: off).",
    )
    calib_inputs: CalibInputs | None = Field(
        None,
        description="What each decoder layer is calibrated on: quantized = the outputs of the "
        "already quantized previous layers (one more forward per layer; the GPTQ authors', "
        "GPTQModel's and llm-compressor's scheme); float = the float model's activations "
        "(msModelSlim). Default from numerics (msquant: quantized; msmodelslim: float).",
    )
    true_sequential: bool | None = Field(
        None,
        description="Inside each decoder layer, quantize the linears of one submodule (the "
        "attention) before the Hessians of the next (the MLP) are gathered, so these see the "
        "quantized attention's outputs (one more calibration pass per layer). Default from "
        "numerics (off for both).",
    )
    damp_auto_increment: float = Field(
        0.01,
        ge=0,
        allow_inf_nan=False,
        description="Added to percdamp after each failed Cholesky factorisation.",
    )
    max_damp_retries: StrictInt = Field(
        10, ge=0, description="How many damping increases are tried before giving up."
    )
    mse: bool | None = Field(
        None,
        description="Search each row's (or group's) scale by shrinking its min/max range to "
        "minimise sum |w - w_q|^mse_norm, instead of plain min/max. Default from numerics "
        "(msquant: on when qconfig's dtype has 4 bits or fewer; msmodelslim: off).",
    )
    mse_grid: MseGrid = 100
    mse_maxshrink: MseMaxShrink = 0.2
    mse_norm: MseNorm = 2.4
    expert_min_tokens: float = Field(
        DEFAULT_EXPERT_TOKEN_RATIO,
        ge=0,
        description="MoE experts whose Hessian got fewer calibration tokens than this times their "
        "in_features are rounded to nearest instead of solved by GPTQ (listed in the run report).",
    )
    experts_per_pass: StrictInt | None = Field(
        None,
        gt=0,
        description="MoE: gather the Hessians of at most this many experts per calibration pass "
        "over a layer (each pass solves its experts, then frees their Hessians), bounding GPTQ "
        "memory for models with many wide experts at the cost of one more layer forward per "
        "pass; the result is identical. Default: all experts in one pass.",
    )

    @model_validator(mode="after")
    def _act_order_needs_static_groups(self) -> GPTQExt:
        """``desc_act`` runs with static groups only: refuse an explicit ``static_groups: false``
        with it instead of overriding it silently."""
        if self.static_groups is False and self.resolved_desc_act():
            origin = (
                "desc_act: true"
                if self.desc_act
                else f"desc_act, on by default with numerics: {self.numerics}"
            )
            raise ValueError(
                f"static_groups: false cannot go with {origin}: msquant runs act-order with static "
                "groups only (the group index stays trivial, the only act-order vLLM 0.33 and "
                "compressed-tensors load); drop static_groups, or set desc_act: false for group "
                "parameters computed during the sweep"
            )
        return self

    @property
    def defaults(self) -> GPTQDefaults:
        """The defaults of the chosen ``numerics``."""
        return GPTQ_NUMERICS[self.numerics]

    def resolved_desc_act(self) -> bool:
        """Act-order, set or from ``numerics``."""
        return self.defaults.desc_act if self.desc_act is None else self.desc_act

    def resolved_static_groups(self) -> bool:
        """Static groups as set (act-order forces them on where it applies)."""
        return bool(self.static_groups)

    def resolved_full_range(self, bits: int) -> bool:
        """The grid for a ``bits``-wide module, set or from ``numerics``."""
        if self.full_range is not None:
            return self.full_range
        return bits <= self.defaults.full_range_max_bits

    def resolved_calib_inputs(self) -> CalibInputs:
        """What layers are calibrated on, set or from ``numerics``."""
        return self.defaults.calib_inputs if self.calib_inputs is None else self.calib_inputs

    def resolved_mse(self, bits: int) -> bool:
        """The MSE scale search for an entry whose ``qconfig`` dtype has ``bits`` bits."""
        return bits <= self.defaults.mse_max_bits if self.mse is None else self.mse

    def resolved_true_sequential(self) -> bool:
        """True-sequential inside a layer, set or from ``numerics``."""
        if self.true_sequential is None:
            return self.defaults.true_sequential
        return self.true_sequential

    def mse_options(self, bits: int = 8) -> MSEOptions | None:
        """The MSE search options for ``bits``-wide ``qconfig``, or None when the search is off."""
        return MSEOptions.from_flags(
            self.resolved_mse(bits), self.mse_grid, self.mse_maxshrink, self.mse_norm
        )


@dataclass(frozen=True)
class WeightMethod:
    """A weight quantization algorithm selectable by ``qconfig.weight.method``."""

    name: str
    ext_model: type[BaseModel]
    dtypes: frozenset[QDType]
    scopes: frozenset[QScope]
    implemented: bool
    summary: str


WEIGHT_METHODS: Mapping[str, WeightMethod] = MappingProxyType(
    {
        "minmax": WeightMethod(
            name="minmax",
            ext_model=MinMaxExt,
            dtypes=frozenset({QDType.INT8, QDType.INT4}),
            scopes=frozenset({QScope.PER_CHANNEL, QScope.PER_GROUP}),
            implemented=True,
            summary="round-to-nearest with min/max scales",
        ),
        "gptq": WeightMethod(
            name="gptq",
            ext_model=GPTQExt,
            dtypes=frozenset({QDType.INT8, QDType.INT4}),
            scopes=frozenset({QScope.PER_CHANNEL, QScope.PER_GROUP}),
            implemented=True,
            summary="GPTQ (Hessian-based error compensation)",
        ),
    }
)
