"""msquant's API for extension authors: processors, quantization methods, export formats and
model adapters.

``msquant`` itself holds what a user of msquant needs (quantize, plan, verify, evaluate, configs,
errors; see docs/api.md). This package holds what a plugin builds on: the processor contract and
its run context, the :class:`Saver` base, the four registries with their entry-point groups, the
planning protocols, the quantization numerics and quantized-linear types, the export writers and
the reading helpers of format readers. The built-in processors (``msquant.processors``) import
nothing else from msquant, and neither should a third-party plugin: the names in ``__all__`` are
the promise (stable within a minor version; docs/api.md), everything under them may change.

Importing this package loads its submodules' dependencies; engine modules import the submodules
(``msquant.plugin.processor``, ...) directly, never this facade, so it adds no import cycle.
"""

from msquant.backends import (
    Backend,
    DeviceSpec,
    get_backend,
    parse_device,
)
from msquant.check.compare import (
    function_tolerance,
    max_relative_error,
)
from msquant.check.flow import (
    FlowPair,
    ov_channel_map,
    prove_flow,
)
from msquant.check.function import (
    FunctionCheck,
    layer_fingerprint,
)
from msquant.check.sharing import (
    shared_weight_problems,
)
from msquant.check.snapshot import (
    LayerSnapshot,
)
from msquant.check.upcast import (
    in_float32,
)
from msquant.errors import (
    ConfigError,
    ConfigIssue,
    MsquantError,
    MsquantInputError,
    QuantizationError,
    RegistryError,
    TransformCheckError,
)
from msquant.export import (
    ShardedSafetensorsWriter,
    StagedOutputDir,
    copy_model_files,
    hf_weights_writer,
    pack_int4_pairs,
    pack_int32,
    packed_length,
    safe_file_stem,
    unique_state_items,
    write_hf_config,
)
from msquant.model.adapter import (
    ModelAdapter,
)
from msquant.model.adapter_registry import (
    MODEL_ADAPTER_GROUP,
    ModelAdapterRegistry,
    adapter_for,
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
from msquant.model.layers import (
    DecoderLayer,
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
from msquant.plugin.context import (
    RunContext,
)
from msquant.plugin.distributed import (
    SINGLE,
    Distributed,
    balanced_owners,
)
from msquant.plugin.format import (
    FORMAT_ENTRY_POINT_GROUP,
    ExportFormat,
    FormatRegistry,
    default_formats,
)
from msquant.plugin.memory import (
    CalibrationSize,
)
from msquant.plugin.method import (
    METHOD_ENTRY_POINT_GROUP,
    CalibratedQuantizer,
    MethodOptions,
    MethodRegistry,
    QuantMethod,
    default_method_registry,
)
from msquant.plugin.processor import (
    OutputHeadUser,
    Processor,
    ProcessorConfig,
    ProcessorConfigList,
    ProcessorContainer,
)
from msquant.plugin.registry import (
    ENTRY_POINT_GROUP,
    ProcessorRegistry,
    default_registry,
)
from msquant.plugin.saver import (
    SAVER_STATE_FORMAT,
    NameSet,
    Saver,
    SaverConfig,
    SaverState,
)
from msquant.plugin.transforms import (
    TransformedExport,
    TransformLog,
    tensor_sha256,
)
from msquant.quant.activation import (
    ActivationQuant,
    OnlineMinMax,
)
from msquant.quant.clip_search import (
    hessian_clip_qparams,
    quantize_weight_hessian_clip,
)
from msquant.quant.gptq import (
    GPTQQuantizer,
    WeightPerChannelGPTQ,
    WeightPerGroupGPTQ,
)
from msquant.quant.gptq_options import (
    GPTQOptions,
)
from msquant.quant.gptq_solver import (
    GPTQResult,
    gptq_quantize,
    resolve_block_size,
)
from msquant.quant.hessian import (
    HessianAccumulator,
)
from msquant.quant.int_quant import (
    compute_qparams,
    dequantize,
    minmax_qparams,
    qrange,
)
from msquant.quant.int_quant import (
    quantize as quantize_codes,
)
from msquant.quant.minifloat import (
    pack_nibbles,
    unpack_nibbles,
)
from msquant.quant.minmax import (
    check_weight,
    divisors,
    quantize_weight_minmax,
)
from msquant.quant.mse_clip import (
    MSEOptions,
    mse_minmax_qparams,
    mse_qparams,
)
from msquant.quant.mx_quant import (
    E8M0_BIAS,
)
from msquant.quant.output_error import (
    relative_output_errors,
)
from msquant.quant.qconfig import (
    ActQConfig,
    LinearQConfig,
    QDType,
    QScope,
    WeightQConfig,
)
from msquant.quant.quantized_linear import (
    QuantizedLinear,
    replace_module,
)
from msquant.quant.quantized_weight import (
    QuantizedWeight,
)
from msquant.quant.rotation import (
    DEFAULT_ROTATION_SEED,
    fuse_norm_into_linear,
    hadamard_core_order,
    is_power_of_two,
    rotate_input,
    rotate_output,
    rotation_for,
)
from msquant.quant.rules import (
    BASE_SOURCE,
    DYNAMIC_KEYS,
    GPTQ_ONLY_KEYS,
    BaseScheme,
    DynamicOverrides,
    DynamicRule,
    FusedNameMismatch,
    ResolvedScheme,
    fused_name_mismatches,
    parse_dynamic,
    resolve_module_scheme,
    written_for_engine_name,
)
from msquant.quant.smoothing import (
    abs_column_max,
    flex_scales,
    fold_into_linear_columns,
    fold_into_linear_rows,
    fold_into_norm,
    iter_scales,
    iter_weight_stat,
    ov_scales_max,
    ov_scales_mean,
    search_alpha_beta,
    update_channel_max,
)
from msquant.quant.value_types import (
    ValueType,
    value_type_named,
)
from msquant.quant.w8a8_params import (
    decode_deq_scale,
    deq_scale,
    encode_deq_scale,
    pack_int4_rows,
    quant_bias,
    scale_bias,
    unpack_int4_rows,
)
from msquant.report.run_report import (
    KVCacheReport,
    ModuleReport,
)
from msquant.run.probe import (
    TransformProbe,
)
from msquant.verify import (
    LayerReport,
)
from msquant.verify.base import (
    ExportReader,
    module_of,
    read_json,
    ties_word_embeddings,
)
from msquant.verify.detect import (
    detect_format,
    hf_export_format,
    hf_quant_method,
    read_model_config,
)
from msquant.verify.layer import (
    DecodedLayer,
    trivial_g_idx,
)
from msquant.verify.report import (
    Findings,
)
from msquant.verify.tensors import (
    TensorStore,
    open_weights,
    weight_files_present,
)
from msquant.verify.unpack import (
    unpack_int4_pairs,
    unpack_int32_stream,
    words_needed,
)

__all__ = [
    # quantization settings of a linear layer (qconfig)
    "LinearQConfig",
    "WeightQConfig",
    "ActQConfig",
    "ActivationQuant",
    "QDType",
    "QScope",
    # processors, savers, methods and the run they take part in
    "Processor",
    "ProcessorConfig",
    "ProcessorConfigList",
    "ProcessorContainer",
    "ProcessorRegistry",
    "default_registry",
    "Saver",
    "SaverConfig",
    "SaverState",
    "SAVER_STATE_FORMAT",
    "NameSet",
    "ENTRY_POINT_GROUP",
    "QuantMethod",
    "MethodOptions",
    "MethodRegistry",
    "CalibratedQuantizer",
    "CalibrationSize",
    "default_method_registry",
    "METHOD_ENTRY_POINT_GROUP",
    "RunContext",
    "TransformLog",
    "TransformedExport",
    "tensor_sha256",
    "DecoderLayer",
    "Distributed",
    "SINGLE",
    "balanced_owners",
    "MoEInfo",
    "enough_expert_tokens",
    "DEFAULT_EXPERT_TOKEN_RATIO",
    "moe_routers",
    "OutputHeadStage",
    "OutputHeadUser",
    "find_output_head",
    "find_final_norm",
    "head_is_tied",
    "tied_head_message",
    "is_selected",
    "first_matching_pattern",
    "pattern_problem",
    "unmatched_patterns",
    # devices
    "Backend",
    "DeviceSpec",
    "get_backend",
    "parse_device",
    # numerics and quantized representation
    "QuantizedWeight",
    "ValueType",
    "value_type_named",
    "pack_nibbles",
    "unpack_nibbles",
    "E8M0_BIAS",
    "QuantizedLinear",
    "OnlineMinMax",
    "decode_deq_scale",
    "deq_scale",
    "encode_deq_scale",
    "quant_bias",
    "scale_bias",
    "pack_int4_rows",
    "unpack_int4_rows",
    "replace_module",
    "quantize_weight_minmax",
    "quantize_weight_hessian_clip",
    "hessian_clip_qparams",
    "GPTQQuantizer",
    "GPTQOptions",
    "WeightPerChannelGPTQ",
    "WeightPerGroupGPTQ",
    "GPTQResult",
    "HessianAccumulator",
    "gptq_quantize",
    "resolve_block_size",
    "check_weight",
    "divisors",
    "compute_qparams",
    "minmax_qparams",
    "MSEOptions",
    "mse_qparams",
    "mse_minmax_qparams",
    "quantize_codes",
    "dequantize",
    "qrange",
    # export helpers
    "StagedOutputDir",
    "ShardedSafetensorsWriter",
    "copy_model_files",
    "safe_file_stem",
    "hf_weights_writer",
    "unique_state_items",
    "write_hf_config",
    "pack_int32",
    "pack_int4_pairs",
    "packed_length",
    # per-module rules and plans
    "build_plan",
    "check_plan",
    "analyse_plan",
    "PlanRow",
    "PlanReview",
    "PlanReviewer",
    "ModelPlan",
    "ModuleDecision",
    "ModulePlanner",
    "KVCachePlan",
    "KVCachePlanner",
    "BaseScheme",
    "ResolvedScheme",
    "DynamicRule",
    "DynamicOverrides",
    "FusedNameMismatch",
    "parse_dynamic",
    "resolve_module_scheme",
    "written_for_engine_name",
    "fused_name_mismatches",
    "BASE_SOURCE",
    "DYNAMIC_KEYS",
    "GPTQ_ONLY_KEYS",
    # model adapters (architecture knowledge keyed by config.model_type)
    "ModelAdapter",
    "ModelAdapterRegistry",
    "MODEL_ADAPTER_GROUP",
    "adapter_for",
    "default_adapter_registry",
    # fused layers
    "FUSED_SHARDS",
    "FusedGroup",
    "fused_groups",
    "engine_names",
    "expert_groups",
    "expert_group_problems",
    "parse_expert_linear",
    "fused_group_problems",
    # export formats: what a reader reports
    "LayerReport",
    # export formats (for format authors: registry, reader contract, reading helpers)
    "ExportFormat",
    "FormatRegistry",
    "default_formats",
    "FORMAT_ENTRY_POINT_GROUP",
    "detect_format",
    "ExportReader",
    "Findings",
    "DecodedLayer",
    "TensorStore",
    "trivial_g_idx",
    "read_json",
    "module_of",
    "ties_word_embeddings",
    "read_model_config",
    "hf_quant_method",
    "hf_export_format",
    "open_weights",
    "weight_files_present",
    "unpack_int32_stream",
    "unpack_int4_pairs",
    "words_needed",
    # the run report's per-module and per-KV-cache records
    "ModuleReport",
    "KVCacheReport",
    "relative_output_errors",
    # errors a plugin raises or reports (also in msquant, for users)
    "MsquantError",
    "MsquantInputError",
    "ConfigError",
    "ConfigIssue",
    "QuantizationError",
    "RegistryError",
    "TransformCheckError",
    # proofs that a transform keeps the model's function (msquant.check)
    "TransformProbe",
    "FlowPair",
    "prove_flow",
    "ov_channel_map",
    "FunctionCheck",
    "layer_fingerprint",
    "LayerSnapshot",
    "shared_weight_problems",
    "function_tolerance",
    "max_relative_error",
    "in_float32",
    "NormForm",
    "NormLayout",
    "measure_norm_form",
    "norm_form_problem",
    # outlier suppression (smoothing) and rotation
    "RotationLayout",
    "LayerRotationLayout",
    "SUBGRAPH_TYPES",
    "SmoothingSubgraph",
    "SubgraphType",
    "unknown_expert_modules",
    "fuse_norm_into_linear",
    "hadamard_core_order",
    "is_power_of_two",
    "rotate_input",
    "rotate_output",
    "rotation_for",
    "DEFAULT_ROTATION_SEED",
    "abs_column_max",
    "flex_scales",
    "fold_into_linear_columns",
    "fold_into_linear_rows",
    "fold_into_norm",
    "iter_scales",
    "iter_weight_stat",
    "ov_scales_max",
    "ov_scales_mean",
    "search_alpha_beta",
    "update_channel_max",
]
