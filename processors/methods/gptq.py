"""``method: gptq``: GPTQ (Hessian-based error compensation), msModelSlim's options plus the
numerics switch (``ext.numerics``), act-order, static groups, the grid, how layers are calibrated,
the Cholesky retry policy and the MSE scale search.

:class:`GPTQExt` is the typed ``ext`` (its defaults are :class:`msquant.plugin.numerics.GPTQOptions`' and
:class:`msquant.plugin.numerics.MSEOptions`'); :class:`GPTQMethod` resolves it, per module, with the
module's rule, through :meth:`GPTQOptions.from_ext` into the one value the solver takes.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal

import torch
from pydantic import Field, StrictInt, model_validator
from pydantic_core import PydanticCustomError

from msquant.plugin import (
    BaseScheme,
    CalibratedQuantizer,
    ConfigIssue,
    DynamicRule,
    MethodOptions,
    QDType,
    QScope,
    QuantizedWeight,
    QuantMethod,
    ResolvedScheme,
)
from msquant.plugin.devices import Backend
from msquant.plugin.numerics import GPTQOptions, GPTQQuantizer, MSEOptions, quantize_codes
from msquant.plugin.planning import DYNAMIC_KEYS
from msquant.processors.methods.options import (
    EXPERT_MIN_TOKENS,
    ExpertMinTokens,
    GroupSize,
    MseGrid,
    MseMaxShrink,
    MseNorm,
    round_to_nearest,
)

__all__ = ["GPTQExt", "GPTQDefaults", "GPTQ_NUMERICS", "GPTQNumerics", "CalibInputs", "GPTQMethod"]

logger = logging.getLogger(__name__)

#: The defaults of the solve's options and of the MSE search: GPTQExt declares no value of its own.
_SOLVE = GPTQOptions()
_SEARCH = MSEOptions()

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


class GPTQExt(MethodOptions):
    """``ext`` options of ``method: gptq``: msModelSlim's (percdamp, block_size, group_size), plus
    the numerics switch, act-order, static groups, the grid, how layers are calibrated, the
    Cholesky retry policy and the MSE clipping search. Options left unset take the defaults of
    ``numerics``."""

    # The defaults are in GPTQ_NUMERICS; the resolved_* methods return the values a run uses.

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
        _SOLVE.percdamp,
        gt=0,
        allow_inf_nan=False,
        description="Damping as a fraction of the mean Hessian diagonal.",
    )
    block_size: StrictInt = Field(
        _SOLVE.block_size,
        gt=0,
        description="Lazy-batch width over input columns (the last block may be shorter).",
    )
    group_size: GroupSize = GPTQOptions.ext_group_size
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
        _SOLVE.damp_auto_increment,
        gt=0,
        allow_inf_nan=False,
        description="Added to percdamp after each failed Cholesky factorisation.",
    )
    max_damp_retries: StrictInt = Field(
        _SOLVE.max_damp_retries,
        ge=0,
        le=GPTQOptions.max_retries,
        description="How many damping increases are tried before giving up "
        f"(0 to {GPTQOptions.max_retries}).",
    )
    mse: bool | None = Field(
        None,
        description="Search each row's (or group's) scale by shrinking its min/max range to "
        "minimise sum |w - w_q|^mse_norm, instead of plain min/max. Default from numerics "
        "(msquant: on when qconfig's dtype has 4 bits or fewer; msmodelslim: off).",
    )
    mse_grid: MseGrid = _SEARCH.grid
    mse_maxshrink: MseMaxShrink = _SEARCH.maxshrink
    mse_norm: MseNorm = _SEARCH.norm
    expert_min_tokens: ExpertMinTokens = EXPERT_MIN_TOKENS
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
            raise PydanticCustomError(
                "act_order_static_groups",
                f"static_groups: false cannot go with {origin}: msquant runs act-order with static "
                "groups only (the group index stays trivial, the only act-order vLLM 0.33 / 0.34 and "
                "compressed-tensors load); drop static_groups, or set desc_act: false for group "
                "parameters computed during the sweep",
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


class GPTQMethod(QuantMethod):
    """GPTQ: each selected module's Hessian is gathered from calibration data, then solved."""

    name = "gptq"
    options_class = GPTQExt
    dtypes = frozenset({QDType.INT8, QDType.INT4})
    scopes = frozenset({QScope.PER_CHANNEL, QScope.PER_GROUP})
    summary = "GPTQ (Hessian-based error compensation)"
    calibrated = True
    rule_keys = DYNAMIC_KEYS
    options: GPTQExt

    def base_scheme(self) -> BaseScheme:
        options = self.options
        mse = options.resolved_mse(self.bits)
        return BaseScheme(
            bits=self.bits,
            group_size=self.group_size,
            sym=self.weight.symmetric,
            desc_act=options.resolved_desc_act(),
            percdamp=options.percdamp,
            mse=options.mse_norm if mse else 0.0,
            static_groups=options.resolved_static_groups(),
            mse_norm=options.mse_norm,
        )

    def config_issues(self, rules: Sequence[DynamicRule]) -> list[ConfigIssue]:
        """A positive rule setting ``static_groups: false`` for modules that run act-order (its
        own ``desc_act: true``, or the entry's): refused, since act-order runs with static groups
        only (a non-trivial group index, which vLLM refuses, would be needed)."""
        issues = []
        for rule in rules:
            overrides = rule.overrides
            if rule.negative or overrides.get("static_groups") is not False:
                continue
            if not overrides.get("desc_act", self.options.resolved_desc_act()):
                continue
            origin = "desc_act: true" if "desc_act" in overrides else "the entry's act-order"
            issues.append(
                ConfigIssue(
                    f"{rule.source}.static_groups",
                    f"static_groups: false cannot go with {origin}: act-order runs with static "
                    "groups only (the group index stays trivial, as vLLM requires); drop "
                    "static_groups from the rule, or add desc_act: false to it",
                )
            )
        return issues

    def quantize_rtn(
        self, weight: torch.Tensor, scheme: ResolvedScheme, name: str
    ) -> QuantizedWeight:
        options = self.options
        full_range = options.resolved_full_range(scheme.bits)
        return round_to_nearest(
            weight, scheme, name, options.mse_grid, options.mse_maxshrink, full_range
        )

    def rtn_baseline(
        self,
        weight: torch.Tensor,
        scheme: ResolvedScheme,
        name: str,
        solved: QuantizedWeight,
        stats: Mapping[str, Any],
    ) -> QuantizedWeight:
        """Round-to-nearest with the solve's own grid parameters where they are the ones
        :meth:`quantize_rtn` would derive: per-channel (taken from the original rows before
        dead columns are zeroed) and static groups without dead columns (taken from the whole
        original weight before the sweep), plain min/max or MSE-searched alike. Dynamic groups
        (parameters of the running weight) and static groups over zeroed dead columns are
        rounded afresh.

        With the MSE search the parameters are the same search over the same values; its
        per-slice error sums are taken over the solver's layout, so a near-tie between two
        shrink factors (equal to float rounding) may pick the other one than a separate
        search would have (only the report's ``rtn_output_error`` can move, in its last digits).
        """
        options = self.solve_options(scheme, name)
        same_grid = options.group_size is None or (
            options.static and stats.get("dead_columns") == 0
        )
        if not same_grid:
            return self.quantize_rtn(weight, scheme, name)
        codes = quantize_codes(weight, solved.scale, solved.offset, solved.bits, solved.group_size)
        return QuantizedWeight(
            codes, solved.scale, solved.offset, solved.bits, solved.symmetric, solved.group_size
        )

    @property
    def calibrate_on_quantized(self) -> bool:
        return self.options.resolved_calib_inputs() == "quantized"

    @property
    def true_sequential(self) -> bool:
        return self.options.resolved_true_sequential()

    @property
    def experts_per_pass(self) -> int | None:
        return self.options.experts_per_pass

    def work_bytes(self, out_features: int, in_features: int) -> int:
        """The solve's working copies: at most three of the float32 weight and three of the
        Hessian (``bench/gptq_memory.py`` measures 4.2 to 5.3 copies of a square layer,
        act-order included; docs/performance.md)."""
        return 3 * 4 * (out_features * in_features + in_features * in_features)

    def solve_options(self, scheme: ResolvedScheme, name: str = "layer") -> GPTQOptions:
        """The solve's options for one module: the entry's ``ext`` with the module's resolved
        scheme (bits, group, sym, act-order, damping, static groups, MSE norm) in place of the
        entry's own values, built by the one constructor, :meth:`GPTQOptions.from_ext`."""
        options = self.options
        per_group = scheme.group_size is not None
        ext: dict[str, Any] = {
            "percdamp": scheme.percdamp,
            "block_size": options.block_size,
            "desc_act": scheme.desc_act,
            "damp_auto_increment": options.damp_auto_increment,
            "max_damp_retries": options.max_damp_retries,
            "mse": bool(scheme.mse),
            "mse_grid": options.mse_grid,
            "mse_maxshrink": options.mse_maxshrink,
            "mse_norm": scheme.mse or options.mse_norm,
            "full_range": options.resolved_full_range(scheme.bits),
        }
        if per_group:
            ext.update(group_size=scheme.group_size, static_groups=scheme.static_groups)
        return GPTQOptions.from_ext(scheme.bits, scheme.sym, ext, name, per_group=per_group)

    def new_quantizer(
        self, name: str, in_features: int, scheme: ResolvedScheme
    ) -> CalibratedQuantizer:
        return GPTQQuantizer(self.solve_options(scheme, name), name, in_features)

    def solve(
        self, quantizer: CalibratedQuantizer, weight: torch.Tensor, backend: Backend
    ) -> tuple[QuantizedWeight, Mapping[str, Any]]:
        assert isinstance(quantizer, GPTQQuantizer)
        result = quantizer.quantize(weight, backend=backend)
        logger.debug(
            "%s: GPTQ loss %.4g, percdamp %.4g (%d retries), %d dead columns, %.2f s",
            quantizer.name, result.loss, result.percdamp, result.damp_retries,
            result.dead_columns, result.seconds,
        )  # fmt: skip
        return result.quantized, {
            "gptq_loss": result.loss,
            "percdamp": result.percdamp,
            "damp_retries": result.damp_retries,
            "dead_columns": result.dead_columns,
            "solve_seconds": result.seconds,
            "tokens": result.nsamples,
        }
