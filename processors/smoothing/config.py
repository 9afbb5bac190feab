"""The YAML of the smoothing processors: msModelSlim 26.1.0's fields and defaults.

``alpha``, ``beta`` and ``scale_min`` are floats strictly between 0 and 1 (msModelSlim's rule);
``enable_subgraph_type`` names msModelSlim's subgraph types; ``include`` / ``exclude`` are globs on
the name of a subgraph's producing module (a norm, ``v_proj``, ``up_proj``), as msModelSlim
matches them. ``symmetric: false`` (msModelSlim's shift of the norm's output by each channel's
midpoint, which adds biases to the norm and the linears) is refused: no shipped best practice
uses it. ``flex_awq_ssz`` takes a ``qconfig`` (``linear_quant``'s schema: the quantization its
search measures), required as in msModelSlim.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from msquant.plugin import ActQConfig, ConfigIssue, ProcessorConfig, QDType, QScope
from msquant.plugin.model import SUBGRAPH_TYPES, SubgraphType, pattern_problem
from msquant.processors.linear_quant.config import MethodQConfig

__all__ = [
    "AWQ_METHODS",
    "FlexAwqSszConfig",
    "FlexSmoothQuantConfig",
    "IterSmoothConfig",
    "SmoothQuantConfig",
    "SmoothingConfig",
    "smoothing_issues",
]

INCLUDE = "globs on the producing module of each subgraph (a norm, v_proj, up_proj); default all"
EXCLUDE = "globs on the producing module of each subgraph left unsmoothed"
SUBGRAPHS = (
    "subgraph types to smooth: norm-linear (a norm -> the linears it feeds), ov (v_proj -> "
    "o_proj), up-down (up_proj -> down_proj), linear-linear (a linear -> the next one); with "
    "--model_type NAME only those msModelSlim's adapter NAME gives this processor (default: "
    "norm-linear), as msModelSlim reads them"
)


#: ``enable_subgraph_type`` of the processors that take it (iter_smooth, flex_smooth_quant,
#: flex_awq_ssz), declared once: its default is every type, in msModelSlim's order.
EnableSubgraphType = Annotated[
    list[str],
    Field(
        default_factory=lambda: ["norm-linear", "linear-linear", "ov", "up-down"],
        description=SUBGRAPHS,
    ),
]


def _open_unit(value: float | None, info: object) -> float | None:
    if value is not None and not 0 < value < 1:
        raise ValueError("must be strictly between 0 and 1 (msModelSlim's range)")
    return value


class SmoothingConfig(ProcessorConfig):
    """Fields every smoothing processor has."""

    include: list[str] | None = Field(default=None, description=INCLUDE)
    exclude: list[str] | None = Field(default=None, description=EXCLUDE)

    @property
    def subgraph_types(self) -> tuple[SubgraphType, ...]:
        """The subgraph types this entry smooths: those of its ``enable_subgraph_type`` where it
        has one, in :data:`SUBGRAPH_TYPES`' order, else every type."""
        enabled = getattr(self, "enable_subgraph_type", None)
        if enabled is None:
            return SUBGRAPH_TYPES
        return tuple(t for t in SUBGRAPH_TYPES if t in enabled)


class SmoothQuantConfig(SmoothingConfig):
    """``smooth_quant``: SmoothQuant on norm -> linears only, ``s = a^alpha / w^(1-alpha)``."""

    type: Literal["smooth_quant"] = "smooth_quant"
    alpha: float = Field(default=0.5, description="migration strength, in (0, 1)")
    symmetric: bool = Field(default=True, description="true only (asymmetric shift refused)")

    _alpha = field_validator("alpha")(_open_unit)

    @property
    def subgraph_types(self) -> tuple[SubgraphType, ...]:
        return ("norm-linear",)


class IterSmoothConfig(SmoothingConfig):
    """``iter_smooth``: ``s = max(a^alpha / w^(1-alpha), scale_min)`` on every subgraph type."""

    type: Literal["iter_smooth"] = "iter_smooth"
    alpha: float = Field(default=0.9, description="migration strength, in (0, 1)")
    scale_min: float = Field(default=1e-5, description="lower bound of a scale, in (0, 1)")
    symmetric: bool = Field(default=True, description="true only (asymmetric shift refused)")
    enable_subgraph_type: EnableSubgraphType

    _unit = field_validator("alpha", "scale_min")(_open_unit)


class FlexSmoothQuantConfig(SmoothingConfig):
    """``flex_smooth_quant``: ``s = a^alpha / w^beta``, alpha and beta searched per subgraph
    when not both given."""

    type: Literal["flex_smooth_quant"] = "flex_smooth_quant"
    alpha: float | None = Field(
        default=None, description="in (0, 1); searched (with beta) when alpha or beta is unset"
    )
    beta: float | None = Field(
        default=None, description="in (0, 1); searched (with alpha) when alpha or beta is unset"
    )
    enable_subgraph_type: EnableSubgraphType

    _unit = field_validator("alpha", "beta")(_open_unit)


#: The weight methods ``flex_awq_ssz``'s search can quantize with: msModelSlim's data-free ones.
AWQ_METHODS = ("minmax", "ssz")
AWQ_QCONFIG = (
    "the quantization the alpha search measures its error under (linear_quant's qconfig): act "
    "per_token int8 symmetric minmax; weight int4 / int8 per_channel symmetric, method ssz or "
    "minmax (required)"
)


class FlexAwqSszConfig(SmoothingConfig):
    """``flex_awq_ssz``: ``s = mean|a|^alpha``, ``alpha`` searched per subgraph on a 0.05 grid by
    the error of the product quantized with ``qconfig`` when not given; ``beta`` is fixed at 0
    (a ``beta`` given is accepted and ignored, as in msModelSlim)."""

    type: Literal["flex_awq_ssz"] = "flex_awq_ssz"
    qconfig: MethodQConfig = Field(description=AWQ_QCONFIG)
    alpha: float | None = Field(default=None, description="in (0, 1); searched when unset")
    beta: float | None = Field(
        default=None, description="in (0, 1); accepted and ignored (flex_awq_ssz's beta is 0)"
    )
    enable_subgraph_type: EnableSubgraphType

    _unit = field_validator("alpha", "beta")(_open_unit)

    @model_validator(mode="before")
    @classmethod
    def _qconfig_given(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("qconfig") is None:
            raise ValueError(
                "flex_awq_ssz needs qconfig: the quantization its alpha search measures (as "
                "msModelSlim requires), e.g. qconfig: {act: {scope: per_token, dtype: int8, "
                "symmetric: true, method: minmax}, weight: {scope: per_channel, dtype: int4, "
                "symmetric: true, method: ssz}}"
            )
        return data


def _act_text(act: ActQConfig) -> str:
    if act.dtype is QDType.FLOAT:
        return "float activations (act unset)"
    symmetry = "symmetric" if act.symmetric else "asymmetric"
    return f"{act.scope.value} {act.dtype.value} {symmetry} {act.method}"


def awq_qconfig_issues(config: FlexAwqSszConfig) -> list[ConfigIssue]:
    """The quantization ``flex_awq_ssz``'s search implements: msModelSlim's dynamic W8A8 / W4A8
    (per-token int8 activations, symmetric per-channel int8 / int4 weights) with a data-free
    weight method."""
    issues = []
    act, weight = config.qconfig.act, config.qconfig.weight
    if (act.dtype, act.scope, act.symmetric, act.method) != (
        QDType.INT8,
        QScope.PER_TOKEN,
        True,
        "minmax",
    ):
        issues.append(
            ConfigIssue(
                "qconfig.act",
                f"flex_awq_ssz searches under per_token int8 symmetric minmax activations "
                f"(msModelSlim's W8A8 / W4A8 dynamic), got {_act_text(act)}; write act: "
                "{scope: per_token, dtype: int8, symmetric: true, method: minmax}",
            )
        )
    if weight.method not in AWQ_METHODS:
        issues.append(
            ConfigIssue(
                "qconfig.weight.method",
                f"flex_awq_ssz quantizes its candidates with method {', '.join(AWQ_METHODS)} "
                f"(data-free, as msModelSlim's search needs), not {weight.method}",
            )
        )
    integer = weight.dtype in (QDType.INT4, QDType.INT8)
    if not integer or weight.scope is not QScope.PER_CHANNEL or not weight.symmetric:
        issues.append(
            ConfigIssue(
                "qconfig.weight",
                f"flex_awq_ssz searches under symmetric per_channel int4 / int8 weights "
                f"(msModelSlim's dynamic fake-quantized layers), got {weight.scope.value} "
                f"{weight.dtype.value} {'symmetric' if weight.symmetric else 'asymmetric'}; "
                "write dtype: int4 or int8, scope: per_channel, symmetric: true",
            )
        )
    return issues


def smoothing_issues(config: SmoothingConfig) -> list[ConfigIssue]:
    """Semantic checks: known subgraph types, valid globs, symmetric smoothing only."""
    issues = []
    for index, name in enumerate(getattr(config, "enable_subgraph_type", [])):
        if name not in SUBGRAPH_TYPES:
            issues.append(
                ConfigIssue(
                    f"enable_subgraph_type[{index}]",
                    f"unknown subgraph type {name!r}; use {', '.join(sorted(SUBGRAPH_TYPES))}",
                )
            )
    if getattr(config, "symmetric", True) is False:
        issues.append(
            ConfigIssue(
                "symmetric",
                "symmetric: false (msModelSlim's shift of each norm channel by its midpoint, which "
                "adds biases to the norm and the linears) is not implemented; use symmetric: true",
            )
        )
    for key in ("include", "exclude"):
        for index, pattern in enumerate(getattr(config, key) or []):
            problem = pattern_problem(pattern)
            if problem:
                issues.append(ConfigIssue(f"{key}[{index}]", problem))
    return issues
