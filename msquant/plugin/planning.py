"""Per-module plans and rules: what a run decides for each linear layer (``ModelPlan``,
``ModuleDecision``, ``PlanRow``), the protocols a processor implements to take part in
planning and review (``ModulePlanner``, ``PlanReviewer``, ``KVCachePlanner``), and the
``dynamic`` override rules. Part of the plugin API (docs/api.md).
"""

from msquant.planning.analysis import (
    analyse_plan,
    check_plan,
)
from msquant.planning.build import (
    build_plan,
)
from msquant.planning.model import (
    KVCachePlan,
    KVCachePlanner,
    ModelPlan,
    ModuleDecision,
    ModulePlanner,
    PlanReview,
    PlanReviewer,
    PlanRow,
)
from msquant.quant.rules import (
    BASE_SOURCE,
    DYNAMIC_KEYS,
    GPTQ_ONLY_KEYS,
    DynamicOverrides,
    FusedNameMismatch,
    fused_name_mismatches,
    parse_dynamic,
    resolve_module_scheme,
    written_for_engine_name,
)

__all__ = [
    "build_plan",
    "check_plan",
    "analyse_plan",
    "ModelPlan",
    "PlanRow",
    "ModuleDecision",
    "ModulePlanner",
    "PlanReview",
    "PlanReviewer",
    "KVCachePlan",
    "KVCachePlanner",
    "DynamicOverrides",
    "FusedNameMismatch",
    "parse_dynamic",
    "resolve_module_scheme",
    "written_for_engine_name",
    "fused_name_mismatches",
    "BASE_SOURCE",
    "DYNAMIC_KEYS",
    "GPTQ_ONLY_KEYS",
]
