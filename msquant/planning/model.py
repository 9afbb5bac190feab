"""The plan's data model: what one quantizing entry decides for a module, a row per linear layer,
the plan of a whole model, and the protocols processors implement to take part in planning.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol, runtime_checkable

from torch import nn

from msquant.model.layers import DecoderLayer
from msquant.quant.rules import BASE_SOURCE, DynamicRule, ResolvedScheme

__all__ = [
    "NOT_SELECTED",
    "ModuleDecision",
    "ModulePlanner",
    "entry_path",
    "source_of",
    "PlanRow",
    "KVCachePlan",
    "KVCachePlanner",
    "ModelPlan",
    "PlanReview",
    "PlanReviewer",
]


NOT_SELECTED = "not selected by any quantizing entry"


@dataclass(frozen=True)
class ModuleDecision:
    """What one quantizing entry decides for one module it considers.

    :param scheme: the resolved scheme (possibly ``skipped`` by a negative rule) when the entry
        selects the module (its include/exclude match it); None when it does not.
    :param method: the entry's method (``minmax``, ``gptq``).
    :param reason: why an unselected module is not selected, e.g. ``exclude *down_proj``
        (empty when no include pattern matched it).
    """

    scheme: ResolvedScheme | None
    method: str
    reason: str = ""
    #: The activation scheme of a selected module (``W8A8``, ``W8A8_DYNAMIC``, ...); None when
    #: its activations stay float.
    act: str | None = None
    #: Whether the selected module is quantized from its weights alone (a data-free weight
    #: method, float or dynamic per-token activations): no calibration data need reach it, so
    #: modules no calibration reaches (a vision-language model's vision tower) may be selected.
    data_free: bool = False
    #: Whether the selected module needs calibration data only for its static activation range
    #: (its weight method reads no data): image calibration gives it to a vision tower's modules.
    static_act_only: bool = False


@runtime_checkable
class ModulePlanner(Protocol):
    """A processor that can say, on the meta model, what it will do to each module."""

    def plan_modules(
        self, model: nn.Module, layers: Sequence[DecoderLayer]
    ) -> Mapping[str, ModuleDecision]:
        """Decision per module name for every module the entry considers (selected or not)."""
        ...

    def plan_rules(self) -> Sequence[DynamicRule]:
        """The entry's ``dynamic`` rules in evaluation order."""
        ...

    def plan_notes(self, model: nn.Module, layers: Sequence[DecoderLayer]) -> list[str]:
        """Warnings about the entry alone (e.g. include patterns matching nothing)."""
        ...


def entry_path(index: int) -> str:
    """``spec.process[index]``."""
    return f"spec.process[{index}]"


def source_of(index: int, scheme: ResolvedScheme) -> str:
    """``spec.process[0]`` (its qconfig) or ``spec.process[0].dynamic["..."]``."""
    if scheme.decided_by == BASE_SOURCE:
        return entry_path(index)
    return f"{entry_path(index)}.{scheme.decided_by}"


@dataclass(frozen=True)
class PlanRow:
    """One linear layer of the plan.

    ``bits``, ``group_size`` (-1 = per-channel), ``sym``, ``desc_act`` and ``method`` are None for
    a module left in float; ``decided_by`` names the entry and rule, e.g.
    ``spec.process[0].dynamic["-:.*down.*"]`` or ``spec.process[0] exclude *down_proj``.
    """

    module: str
    bits: int | None
    group_size: int | None
    sym: bool | None
    desc_act: bool | None
    method: str | None
    skipped: bool
    decided_by: str
    entry: int | None
    #: The activation scheme (``W8A8``, ``W8A8_DYNAMIC``, ...) of a quantized module; None for
    #: float activations.
    act: str | None = None
    #: The codes' value type (``int8``, ``mxfp8``; :mod:`msquant.quant.value_types`) of a
    #: quantized module; None for a module left in float.
    value_type: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready mapping."""
        return asdict(self)


@dataclass(frozen=True)
class KVCachePlan:
    """One attention a KV-cache entry considers: the cache's scheme (``C8``) when the entry
    quantizes it, None when it stays in float; ``decided_by`` names the entry
    (``spec.process[2]``)."""

    module: str
    scheme: str | None
    decided_by: str

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready mapping."""
        return asdict(self)


@runtime_checkable
class KVCachePlanner(Protocol):
    """A processor that quantizes attentions' KV caches and can say which, on the meta model."""

    def plan_kv_caches(
        self, model: nn.Module, layers: Sequence[DecoderLayer]
    ) -> Mapping[str, str | None]:
        """Per attention module the entry considers: the cache's scheme, or None (left float)."""
        ...


@dataclass
class ModelPlan:
    """The plan of a whole model: rows in model order, errors (the run is refused) and warnings;
    ``kv_caches``: the attentions KV-cache entries consider (empty when none does)."""

    rows: list[PlanRow]
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    model_type: str = "unknown"
    kv_caches: list[KVCachePlan] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """No error: the config can be applied to this model."""
        return not self.errors

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready mapping (``msquant plan --json``)."""
        return {
            "ok": self.ok,
            "model_type": self.model_type,
            "rows": [row.to_dict() for row in self.rows],
            "kv_caches": [cache.to_dict() for cache in self.kv_caches],
            "errors": list(self.errors),
            "warnings": list(self.warnings),
        }


@dataclass
class PlanReview:
    """What a :class:`PlanReviewer` found in a plan: errors refuse the run, warnings are logged
    (both are shown by ``msquant plan``). Messages name the reviewer, e.g. ``gptq_saver: ...``."""

    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


@runtime_checkable
class PlanReviewer(Protocol):
    """A processor (usually a saver) that checks the whole plan against what the consumers of
    its output load, before any weight is loaded."""

    def review_plan(self, plan: ModelPlan, model: nn.Module) -> PlanReview:
        """Problems of ``plan`` (every linear layer's scheme, the output head included) for this
        processor's consumers; ``model`` is the weightless model the plan was made on."""
        ...
