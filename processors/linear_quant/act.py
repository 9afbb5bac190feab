"""Activation quantization in ``linear_quant`` (``qconfig.act``): which schemes are implemented,
their config checks, and the online calibration of static (per-tensor) activation ranges.

Implemented (msModelSlim's W8A8 family, the schemes vLLM-Ascend serves for dense layers):

* **W8A8** (static): ``act: {dtype: int8, scope: per_tensor, symmetric: true|false, method:
  minmax}`` with int8 per-channel symmetric ``minmax`` weights. ``input_scale`` / ``input_offset``
  are calibrated as msModelSlim 26.1.0 calibrates them (established on its exports, see
  docs/ascend-format.md): the samples go through each layer one at a time in the dataset's order;
  every selected linear first widens its running min/max with the sample's input
  (:class:`msquant.plugin.numerics.OnlineMinMax`), then computes its output from that input fake-quantized with the
  range seen so far and from its fake-quantized weight; those outputs feed the rest of the layer
  and the next layer.
* **W8A8_MIX** (msModelSlim's ``scope: pd_mix``): ``act: {dtype: int8, scope: pd_mix, symmetric:
  false, method: minmax}`` with the W8A8 weights: the static asymmetric per-tensor range of the
  decode steps is calibrated as W8A8's (online, sample by sample), while the calibration forward
  computes the linear's output from its input quantized per token (the prefill path, which
  calibration prompts take) and its fake-quantized weight.
* **W8A8_DYNAMIC**: ``act: {dtype: int8, scope: per_token, symmetric: true, method: minmax}`` with
  int8 per-channel symmetric ``minmax`` weights; nothing is calibrated (each token is scaled at
  run time), so the weights are quantized without calibration data.
* **W4A8_DYNAMIC**: the same activations with int4 per-channel symmetric ``minmax`` weights
  (msModelSlim 26.1.0 has no per-group W4A8_DYNAMIC layer either).
* **SSZ weights** (``method: ssz``) wherever ``minmax`` weights go: it rounds each module on its own
  too (its scales searched per channel), as msModelSlim's W8A8 / W8A8_DYNAMIC / W4A8_DYNAMIC best
  practices use it.
* **GPTQ weights** (``method: gptq``, per-channel symmetric int8 / int4) with per-token
  activations (W8A8_DYNAMIC, W4A8_DYNAMIC), which msModelSlim cannot do. GPTQ's Hessian sees each
  linear's input as it reaches the layer in the quantized model: the previous decoder layers
  quantized, weights *and* per-token activations (their :class:`msquant.plugin.QuantizedLinear` fake-
  quantizes its input), but the linear's own input not rounded to int8. Per-token rounding is
  applied afresh to every token at run time and adds an error of at most half a step
  (``max|x_token| / 254``) per entry, independent of the weight; GPTQ minimises ``||W X - Q X||``
  over the activations the deployed layer receives before its own rounding. Static (per-tensor)
  activations with GPTQ weights are not implemented (their online calibration runs on the
  round-to-nearest weights).

* **W8A8 fp8** (msModelSlim's ``WFP8AFP8_DYNAMIC``): ``act: {dtype: fp8_e4m3, scope: per_token,
  symmetric: true, method: minmax}`` with ``weight: {dtype: fp8_e4m3, scope: per_channel,
  symmetric: true, method: minmax}``: ``float8_e4m3fn`` weights with one ``amax / 448`` scale per
  output channel, activations scaled per token at run time; nothing calibrated
  (:class:`msquant.plugin.FP8Values`).
* **MX** (OCP microscaling, msModelSlim's ``per_block`` ``mxfp8`` / ``mxfp4``): ``act: {dtype:
  mxfp8 | mxfp4, scope: per_block, symmetric: true, method: minmax, ext: {axes: -1}}`` with
  ``weight: {dtype: mxfp8 | mxfp4, scope: per_block, symmetric: true, method: minmax}``:
  W8A8_MXFP8 (both mxfp8), W4A4_MXFP4 (both mxfp4), W4A8_MXFP (mxfp4 weights, mxfp8
  activations). Blocks of 32 along the input features (``axes: -1``, the default and the only
  axis msModelSlim's linears use); dynamic, nothing calibrated. The value types' numerics are
  :mod:`msquant.quant.mx_quant`.

Everything else with quantized activations is refused with the list above.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from msquant.plugin import (
    ActivationQuant,
    ActQConfig,
    ConfigIssue,
    QDType,
    QScope,
    QuantizationError,
    WeightQConfig,
)
from msquant.plugin.numerics import OnlineMinMax

__all__ = [
    "ACT_SCHEMES",
    "MX_DTYPES",
    "STATIC_SCHEMES",
    "FP8_DTYPES",
    "ActScheme",
    "StaticActCalibration",
    "act_issues",
    "act_scheme",
    "fp8_activation",
    "fp8_issues",
    "mx_activation",
    "mx_issues",
]

#: The integer activation schemes; MX ones are named by :meth:`ActivationQuant.scheme_name`
#: (W8A8_MXFP8, W4A4_MXFP4, W4A8_MXFP).
ActScheme = Literal["W8A8", "W8A8_MIX", "W8A8_DYNAMIC", "W4A8_DYNAMIC"]
#: The schemes whose activation range is calibrated (static per-tensor parameters stored).
STATIC_SCHEMES = ("W8A8", "W8A8_MIX")

#: The activation schemes implemented, as named in the refusal message.
ACT_SCHEMES = (
    "W8A8 = act {dtype: int8, scope: per_tensor, symmetric: true or false, method: minmax} with "
    "weight {dtype: int8, scope: per_channel, symmetric: true, method: minmax}; "
    "W8A8_DYNAMIC = act {dtype: int8, scope: per_token, symmetric: true, method: minmax} with the "
    "same weight; W8A8_MIX = act {dtype: int8, scope: pd_mix, symmetric: false, method: minmax} "
    "with the same weight; W4A8_DYNAMIC = the same act with weight {dtype: int4, scope: per_channel, "
    "symmetric: true, method: minmax}; method: ssz wherever minmax is; with per_token act, "
    "method: gptq too; MX: act {dtype: mxfp8 or mxfp4, scope: per_block, symmetric: true, "
    "method: minmax} with weight {dtype: mxfp8 or mxfp4, scope: per_block, symmetric: true, "
    "method: minmax} (W8A8_MXFP8, W4A4_MXFP4, and W4A8_MXFP = mxfp4 weight with mxfp8 act); "
    "W8A8 fp8 (WFP8AFP8_DYNAMIC) = act {dtype: fp8_e4m3, scope: per_token, symmetric: true, "
    "method: minmax} with weight {dtype: fp8_e4m3, scope: per_channel, symmetric: true, "
    "method: minmax}"
)
#: The MX dtypes (value types computing their own block scales). Which (weight, act) pairs a
#: format stores, its saver says (``activation_schemes``): the plan refuses the others.
MX_DTYPES = tuple(
    dtype for dtype in QDType if dtype.self_scaled and dtype.value_type.block_size is not None
)
#: The per-channel float dtypes (``fp8_e4m3``): W8A8 fp8, msModelSlim's WFP8AFP8_DYNAMIC.
FP8_DTYPES = tuple(
    dtype for dtype in QDType if dtype.self_scaled and dtype.value_type.block_size is None
)

#: The prefill path of W8A8_MIX: each token on its own symmetric grid.
PER_TOKEN = ActivationQuant("per_token")

#: Weight methods that round each module on its own, and so go with every activation scheme.
ROUNDING_METHODS = ("minmax", "ssz")


def act_scheme(act: ActQConfig, weight: WeightQConfig) -> str | None:
    """The scheme ``qconfig.act`` (with these weights) asks for (None: float activations);
    assumes :func:`act_issues` found nothing."""
    if act.dtype is QDType.FLOAT:
        return None
    if act.dtype in MX_DTYPES:
        return mx_activation(act).scheme_name(weight.dtype.bits)
    if act.dtype in FP8_DTYPES:
        return fp8_activation(act).scheme_name(weight.dtype.bits)
    if act.scope is QScope.PER_TENSOR:
        return "W8A8"
    if act.scope is QScope.PD_MIX:
        return "W8A8_MIX"
    return "W4A8_DYNAMIC" if weight.dtype is QDType.INT4 else "W8A8_DYNAMIC"


def act_issues(
    act: ActQConfig, weight: WeightQConfig, lm_head: bool, dynamic: bool
) -> list[ConfigIssue]:
    """Why ``qconfig.act`` (with this weight config) is not implemented, if it is not.

    :param lm_head: the entry quantizes the output head (msModelSlim never quantizes it with
        activations, and no Ascend scheme serves a quantized head with them).
    :param dynamic: the entry has ``dynamic`` rules (per-module weight overrides).
    """
    if act.dtype in FP8_DTYPES or weight.dtype in FP8_DTYPES:
        if act.dtype is QDType.FLOAT:
            return [
                ConfigIssue(
                    "qconfig.act",
                    f"{weight.dtype.value} weights with float activations are not implemented "
                    "(msModelSlim's only FP8 linear is W8A8 fp8, WFP8AFP8_DYNAMIC); quantize the "
                    f"activations: act {{dtype: {weight.dtype.value}, scope: per_token, "
                    "symmetric: true, method: minmax}",
                )
            ]
        return fp8_issues(act, weight) + _entry_issues(lm_head, dynamic)
    if act.dtype is QDType.FLOAT:
        if weight.dtype in MX_DTYPES:
            return [
                ConfigIssue(
                    "qconfig.act",
                    f"{weight.dtype.value} weights with float activations are not implemented "
                    "(msModelSlim has no weight-only MX layer, the Ascend format no type for "
                    f"it); quantize the activations: act {{dtype: {weight.dtype.value}, scope: "
                    "per_block, symmetric: true, method: minmax}",
                )
            ]
        return []
    if act.dtype in MX_DTYPES or weight.dtype in MX_DTYPES:
        return mx_issues(act, weight) + _entry_issues(lm_head, dynamic)
    issues = []
    given = (
        f"act {{dtype: {act.dtype.value}, scope: {act.scope.value}, "
        f"symmetric: {str(act.symmetric).lower()}, method: {act.method}}}"
    )
    known_act = (
        act.dtype is QDType.INT8
        and act.method == "minmax"
        and (
            act.scope is QScope.PER_TENSOR
            or (act.scope is QScope.PER_TOKEN and act.symmetric)
            or (act.scope is QScope.PD_MIX and not act.symmetric)
        )
    )
    if not known_act:
        issues.append(
            ConfigIssue("qconfig.act", f"{given} is not implemented; implemented: {ACT_SCHEMES}")
        )
    if act.ext:
        issues.append(
            ConfigIssue(
                "qconfig.act.ext",
                f"no ext option is implemented for activations, got {sorted(act.ext)}",
            )
        )
    per_token = act.scope is QScope.PER_TOKEN
    weight_ok = (
        (weight.dtype is QDType.INT8 or (weight.dtype is QDType.INT4 and per_token))
        and weight.scope is QScope.PER_CHANNEL
        and weight.symmetric
        and (weight.method in ROUNDING_METHODS or (weight.method == "gptq" and per_token))
    )
    if known_act and not weight_ok:
        issues.append(
            ConfigIssue(
                "qconfig.weight",
                f"weight {{dtype: {weight.dtype.value}, scope: {weight.scope.value}, symmetric: "
                f"{str(weight.symmetric).lower()}, method: {weight.method}}} with quantized "
                f"activations is not implemented; implemented: {ACT_SCHEMES}",
            )
        )
    return issues + _entry_issues(lm_head, dynamic)


def _entry_issues(lm_head: bool, dynamic: bool) -> list[ConfigIssue]:
    """The entry-level settings quantized activations do not go with."""
    issues = []
    if lm_head:
        issues.append(
            ConfigIssue(
                "lm_head",
                "lm_head: true with quantized activations is not implemented (msModelSlim keeps "
                "the head float); drop lm_head or use float activations",
            )
        )
    if dynamic:
        issues.append(
            ConfigIssue(
                "dynamic",
                "dynamic rules with quantized activations are not implemented; select the modules "
                "with include / exclude instead",
            )
        )
    return issues


def _describe(config: ActQConfig | WeightQConfig) -> str:
    return (
        f"{{dtype: {config.dtype.value}, scope: {config.scope.value}, "
        f"symmetric: {str(config.symmetric).lower()}, method: {config.method}}}"
    )


def fp8_activation(act: ActQConfig) -> ActivationQuant:
    """The dynamic per-token activation scheme of an ``fp8_e4m3`` ``qconfig.act``."""
    return ActivationQuant("per_token", value_type=act.dtype.value_type.name)


def fp8_issues(act: ActQConfig, weight: WeightQConfig) -> list[ConfigIssue]:
    """Why an FP8 ``qconfig`` (either side ``fp8_e4m3``) is not implemented, if it is not: W8A8
    fp8 is ``fp8_e4m3`` ``per_token`` symmetric ``minmax`` activations with ``fp8_e4m3``
    ``per_channel`` symmetric ``minmax`` weights (msModelSlim's only FP8 linear,
    ``WFP8AFP8DynamicPerChannelFakeQuantLinear``; its static per-tensor FP8 activations have no
    linear layer)."""
    issues = []
    if not (
        act.dtype in FP8_DTYPES
        and act.scope is QScope.PER_TOKEN
        and act.symmetric
        and act.method == "minmax"
    ):
        issues.append(
            ConfigIssue(
                "qconfig.act",
                f"act {_describe(act)} is not implemented with weight {_describe(weight)}; "
                f"implemented: {ACT_SCHEMES}",
            )
        )
    if not (
        weight.dtype in FP8_DTYPES
        and weight.scope is QScope.PER_CHANNEL
        and weight.symmetric
        and weight.method == "minmax"
    ):
        issues.append(
            ConfigIssue(
                "qconfig.weight",
                f"weight {_describe(weight)} with act {_describe(act)} is not implemented; "
                f"implemented: {ACT_SCHEMES}",
            )
        )
    if act.ext:
        issues.append(
            ConfigIssue(
                "qconfig.act.ext",
                f"no ext option is implemented for FP8 activations, got {sorted(act.ext)}",
            )
        )
    return issues


def mx_activation(act: ActQConfig) -> ActivationQuant:
    """The dynamic per-block activation scheme of an MX ``qconfig.act``."""
    return ActivationQuant("per_block", value_type=act.dtype.value_type.name)


def mx_issues(act: ActQConfig, weight: WeightQConfig) -> list[ConfigIssue]:
    """Why an MX ``qconfig`` (either side ``mxfp8`` / ``mxfp4``) is not implemented, if it is
    not: both sides MX ``per_block`` symmetric ``minmax``,
    blocks along the last axis (``ext.axes: -1``). Which (weight, act) pairs a format stores is the
    saver's to say (the plan refuses the others: the Ascend format has W8A8_MXFP8, W4A4_MXFP4 and
    W4A8_MXFP, msModelSlim's layers)."""
    issues = []
    if not (
        act.dtype in MX_DTYPES
        and act.scope is QScope.PER_BLOCK
        and act.symmetric
        and act.method == "minmax"
    ):
        issues.append(
            ConfigIssue(
                "qconfig.act",
                f"act {_describe(act)} is not implemented with weight {_describe(weight)}; "
                f"implemented: {ACT_SCHEMES}",
            )
        )
    # the (dtype, scope) pairing itself is the method's check (minmax: per_block with MX only)
    if not (weight.dtype in MX_DTYPES and weight.symmetric and weight.method == "minmax"):
        issues.append(
            ConfigIssue(
                "qconfig.weight",
                f"weight {_describe(weight)} with act {_describe(act)} is not implemented; "
                f"implemented: {ACT_SCHEMES}",
            )
        )
    unknown = sorted(set(act.ext) - {"axes"})
    if unknown:
        issues.append(
            ConfigIssue(
                "qconfig.act.ext",
                f"MX activations take only ext.axes, got {unknown}",
            )
        )
    if act.ext.get("axes", -1) != -1:
        issues.append(
            ConfigIssue(
                "qconfig.act.ext.axes",
                f"MX blocks run along the last dimension (axes: -1, the input features), got "
                f"{act.ext['axes']!r}",
            )
        )
    return issues


class StaticActCalibration:
    """Online calibration of the per-tensor input ranges of one layer's selected linears.

    :meth:`hook` replaces a linear's forward (an instance attribute, removed by :meth:`unhook`)
    by ``F.linear(observer.observe(x), fake_weight, bias)``: the running range widened with the
    input, the input fake-quantized with it, the weight fake-quantized. With ``pd_mix`` the input
    is fake-quantized per token instead (the prefill path), the range still widened with it.
    """

    def __init__(self, symmetric: bool, pd_mix: bool = False) -> None:
        self.symmetric = symmetric
        self.pd_mix = pd_mix
        self.observers: dict[str, OnlineMinMax] = {}
        self._hooked: list[nn.Linear] = []

    def hook(self, name: str, module: nn.Linear, fake_weight: torch.Tensor) -> None:
        """Calibrate ``module``'s input range from now on (``fake_weight``: its dequantized
        quantized weight, in the weight's dtype)."""
        observer = self.observers[name] = OnlineMinMax(self.symmetric)
        module.forward = _observed_forward(name, observer, fake_weight, module.bias, self.pd_mix)  # type: ignore[method-assign, assignment]
        self._hooked.append(module)

    def unhook(self) -> None:
        """Give the hooked linears their own forward back."""
        for module in self._hooked:
            del module.forward
        self._hooked.clear()

    def take(self, name: str) -> ActivationQuant:
        """The calibrated scheme of ``name`` (its observer forgotten).

        :raises QuantizationError: when no calibration token reached the module.
        """
        observer = self.observers.pop(name)
        if observer.batches == 0:
            raise QuantizationError(
                f"{name}: no calibration token reached this layer, so its static activation range "
                "is unknown; exclude it or use scope: per_token activations"
            )
        scale, offset = observer.qparams()
        if self.pd_mix:
            return ActivationQuant("pd_mix", self.symmetric, scale, offset)
        return ActivationQuant("per_tensor", self.symmetric, scale, offset)


def _observed_forward(
    name: str,
    observer: OnlineMinMax,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    pd_mix: bool = False,
) -> Callable[[torch.Tensor], torch.Tensor]:
    def forward(x: torch.Tensor) -> torch.Tensor:
        if x.numel() and not bool(torch.isfinite(torch.stack(torch.aminmax(x))).all()):
            raise QuantizationError(
                f"{name}: its calibration inputs {tuple(x.shape)} hold NaN/Inf, so no static "
                "activation range exists; the layer's inputs overflowed upstream (the "
                "checkpoint's weights were checked to be finite and below 2^64) or the "
                "calibration data is broken"
            )
        quantized = observer.observe(x)
        if pd_mix:
            quantized = PER_TOKEN.fake_quantize(x)
        return F.linear(quantized, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))

    return forward
