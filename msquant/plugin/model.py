"""Architecture knowledge a processor reads from a model, through its adapter: fused and
routed-expert linears, the output head, MoE routers and token counts, name patterns,
smoothing subgraphs and rotation layouts, norm forms, the model-adapter registry, and
``replace_module`` / ``balanced_owners`` for the glue. Part of the plugin API (docs/api.md).
"""

from msquant.contracts.distributed import (
    balanced_owners,
)
from msquant.model.adapter_registry import (
    ModelAdapterRegistry,
    default_adapter_registry,
)
from msquant.model.fused import (
    FUSED_SHARDS,
    FusedGroup,
    engine_names,
    expert_group_problems,
    expert_groups,
    fused_group_problems,
    fused_groups,
    parse_expert_linear,
)
from msquant.model.head import (
    OutputHeadStage,
    find_final_norm,
    find_output_head,
    head_is_tied,
    tied_head_message,
)
from msquant.model.matching import (
    first_matching_pattern,
    is_selected,
    pattern_problem,
    unmatched_patterns,
)
from msquant.model.moe import (
    DEFAULT_EXPERT_TOKEN_RATIO,
    MoEInfo,
    enough_expert_tokens,
    moe_routers,
)
from msquant.model.norms import (
    NormForm,
    NormLayout,
    measure_norm_form,
    norm_form_problem,
)
from msquant.model.rotation_layout import (
    LayerRotationLayout,
    RotationLayout,
)
from msquant.model.subgraphs import (
    SUBGRAPH_TYPES,
    SmoothingSubgraph,
    SubgraphType,
    unknown_expert_modules,
)
from msquant.quant.quantized_linear import (
    replace_module,
)

__all__ = [
    "ModelAdapterRegistry",
    "default_adapter_registry",
    "MoEInfo",
    "enough_expert_tokens",
    "DEFAULT_EXPERT_TOKEN_RATIO",
    "moe_routers",
    "OutputHeadStage",
    "find_output_head",
    "find_final_norm",
    "head_is_tied",
    "tied_head_message",
    "is_selected",
    "first_matching_pattern",
    "pattern_problem",
    "unmatched_patterns",
    "FUSED_SHARDS",
    "FusedGroup",
    "fused_groups",
    "engine_names",
    "expert_groups",
    "expert_group_problems",
    "parse_expert_linear",
    "fused_group_problems",
    "unknown_expert_modules",
    "RotationLayout",
    "LayerRotationLayout",
    "SUBGRAPH_TYPES",
    "SmoothingSubgraph",
    "SubgraphType",
    "NormForm",
    "NormLayout",
    "measure_norm_form",
    "norm_form_problem",
    "replace_module",
    "balanced_owners",
]
