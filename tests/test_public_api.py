"""The public API, split by audience (issue 15 point 6): ``msquant`` for users, ``msquant.plugin``
for processor, method, format and model-adapter authors (docs/api.md).

The two ``__all__`` lists below are the promise: a name added or removed is a change of the
public API and must be made here and in docs/api.md on purpose. Every promised name is
documented, nothing else is importable from either facade, the built-in processors use only
these names (as a third-party plugin would), and no engine module imports a facade.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from import_graph import FACADES, import_graph

import msquant
import msquant.plugin

REPO = Path(__file__).resolve().parents[1]

USER_API = [
    "__version__",
    "quantize",
    "QuantizeResult",
    "plan",
    "PlanRow",
    "QuantConfig",
    "load_config",
    "load_config_text",
    "validate_config",
    "config_json_schema",
    "verify_export",
    "check_export",
    "VerifyReport",
    "evaluate_perplexity",
    "compare_perplexity",
    "PerplexityResult",
    "PerplexityComparison",
    "RunReport",
    "load_report",
    "compare_reports",
    "load_baseline_report",
    "RegressionResult",
    "MsquantError",
    "MsquantInputError",
    "ConfigError",
    "ConfigIssue",
    "ModelLoadError",
    "CalibrationDataError",
    "DeviceError",
    "OutputPathError",
    "QuantizationError",
    "TransformCheckError",
    "NotImplementedYetError",
    "RegistryError",
    "ResumeError",
    "ExportReadError",
    "ExportVerificationError",
    "EvaluationError",
]

PLUGIN_API = [
    # qconfig
    *("LinearQConfig", "WeightQConfig", "ActQConfig", "ActivationQuant", "QDType", "QScope"),
    # processors, savers, methods, the run they take part in
    *("Processor", "ProcessorConfig", "ProcessorRegistry", "default_registry", "Saver"),
    *("ProcessorConfigList", "ProcessorContainer"),
    # outlier suppression (smoothing) and rotation
    "RotationLayout",
    "SUBGRAPH_TYPES",
    "SmoothingSubgraph",
    "SubgraphType",
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
    *("SaverConfig", "SaverState", "SAVER_STATE_FORMAT", "NameSet", "ENTRY_POINT_GROUP"),
    *("QuantMethod", "MethodOptions", "MethodRegistry", "CalibratedQuantizer"),
    "CalibrationSize",
    *("default_method_registry", "METHOD_ENTRY_POINT_GROUP", "RunContext", "DecoderLayer"),
    *("TransformLog", "TransformedExport", "tensor_sha256"),
    *("Distributed", "SINGLE", "balanced_owners", "MoEInfo", "enough_expert_tokens"),
    *("DEFAULT_EXPERT_TOKEN_RATIO", "moe_routers", "OutputHeadStage", "OutputHeadUser"),
    *("find_output_head", "find_final_norm", "head_is_tied", "tied_head_message"),
    *("is_selected", "first_matching_pattern", "pattern_problem", "unmatched_patterns"),
    # devices
    *("Backend", "DeviceSpec", "get_backend", "parse_device"),
    # numerics and the quantized representation
    *("QuantizedWeight", "QuantizedLinear", "OnlineMinMax", "decode_deq_scale", "deq_scale"),
    # the quantized-value contract (docs/value-types.md) and the MX storage helpers
    *("ValueType", "value_type_named", "pack_nibbles", "unpack_nibbles", "E8M0_BIAS"),
    *("encode_deq_scale", "quant_bias", "scale_bias", "pack_int4_rows", "unpack_int4_rows"),
    *("replace_module", "quantize_weight_minmax", "quantize_weight_hessian_clip"),
    *("hessian_clip_qparams", "GPTQQuantizer", "GPTQOptions", "WeightPerChannelGPTQ"),
    *("WeightPerGroupGPTQ", "GPTQResult", "HessianAccumulator", "gptq_quantize"),
    *("resolve_block_size", "check_weight", "divisors", "compute_qparams", "minmax_qparams"),
    *("MSEOptions", "mse_qparams", "mse_minmax_qparams", "quantize_codes", "dequantize", "qrange"),
    # export writers
    *("StagedOutputDir", "ShardedSafetensorsWriter", "copy_model_files", "safe_file_stem"),
    *("hf_weights_writer", "unique_state_items", "write_hf_config", "pack_int32"),
    *("pack_int4_pairs", "packed_length"),
    # per-module rules and the planning protocols
    *("build_plan", "check_plan", "analyse_plan", "PlanReview", "PlanReviewer", "ModelPlan"),
    *("PlanRow", "KVCachePlan", "KVCachePlanner"),
    *("ModuleDecision", "ModulePlanner", "BaseScheme", "ResolvedScheme", "DynamicRule"),
    *("DynamicOverrides", "FusedNameMismatch", "parse_dynamic", "resolve_module_scheme"),
    *("written_for_engine_name", "fused_name_mismatches", "BASE_SOURCE", "DYNAMIC_KEYS"),
    "GPTQ_ONLY_KEYS",
    # model adapters and fused layers
    *("ModelAdapter", "ModelAdapterRegistry", "MODEL_ADAPTER_GROUP", "adapter_for"),
    *("default_adapter_registry", "FUSED_SHARDS", "FusedGroup", "fused_groups", "engine_names"),
    *("expert_groups", "expert_group_problems", "parse_expert_linear", "fused_group_problems"),
    "unknown_expert_modules",
    # export formats: registry, reader contract, reading helpers
    *("LayerReport", "ExportFormat", "FormatRegistry", "default_formats"),
    *("FORMAT_ENTRY_POINT_GROUP", "detect_format", "ExportReader", "Findings", "DecodedLayer"),
    *("TensorStore", "trivial_g_idx", "read_json", "module_of", "ties_word_embeddings"),
    *("read_model_config", "hf_quant_method", "hf_export_format", "open_weights"),
    *("weight_files_present", "unpack_int32_stream", "unpack_int4_pairs", "words_needed"),
    # the run report's per-module and per-KV-cache records
    *("ModuleReport", "KVCacheReport", "relative_output_errors"),
    # errors a plugin raises or reports (also in msquant)
    *("MsquantError", "MsquantInputError", "ConfigError", "ConfigIssue", "QuantizationError"),
    *("RegistryError", "TransformCheckError"),
    # proofs that a transform keeps the model's function (msquant.check)
    *("TransformProbe", "FlowPair", "prove_flow", "ov_channel_map", "FunctionCheck"),
    *("layer_fingerprint", "shared_weight_problems", "function_tolerance", "max_relative_error"),
    *("in_float32", "NormForm", "NormLayout", "measure_norm_form", "norm_form_problem"),
    *("LayerRotationLayout", "LayerSnapshot"),
]


def test_the_user_api_is_the_promised_list() -> None:
    assert sorted(msquant.__all__) == sorted(USER_API)
    assert len(set(msquant.__all__)) == len(msquant.__all__) == 38


def test_the_plugin_api_is_the_promised_list() -> None:
    assert sorted(msquant.plugin.__all__) == sorted(PLUGIN_API)
    assert len(set(msquant.plugin.__all__)) == len(msquant.plugin.__all__) == 205


def test_the_facades_hold_nothing_but_their_lists() -> None:
    """No leftover name (no compatibility shim): what is not in ``__all__`` is not importable
    from a facade, apart from its subpackages and the ``plugin`` facade inside ``msquant``."""
    for facade in (msquant, msquant.plugin):
        extra = {
            name
            for name, value in vars(facade).items()
            if not name.startswith("_") and not inspect.ismodule(value)
        }
        assert sorted(extra - set(facade.__all__)) == [], facade.__name__


def test_every_promised_name_is_importable_and_documented() -> None:
    """Classes and functions carry a docstring of their own; constants a ``#:`` comment on the
    line above their assignment in the module that defines them."""
    undocumented = []
    for facade in (msquant, msquant.plugin):
        origins = _facade_origins(facade)
        for name in facade.__all__:
            value = getattr(facade, name)
            if inspect.isclass(value) or inspect.isroutine(value):
                if not (value.__doc__ or "").strip():
                    undocumented.append(f"{facade.__name__}.{name}")
            elif not _has_doc_comment(origins[name]):
                undocumented.append(f"{facade.__name__}.{name}")
    assert undocumented == []


def test_the_doc_check_sees_a_missing_doc_comment(tmp_path: Path) -> None:
    """The checker itself: a constant with a ``#:`` comment passes, one without fails."""
    module = tmp_path / "mod.py"
    module.write_text('#: The group.\nGROUP = "g"\n\nOTHER = 1\n', encoding="utf-8")
    assert _has_doc_comment((module, "GROUP"))
    assert not _has_doc_comment((module, "OTHER"))


def test_the_builtin_processors_use_only_the_public_api() -> None:
    """Every ``msquant`` name the built-in processors (``processors/``) import or use is in
    ``msquant.__all__`` or ``msquant.plugin.__all__``: they are written as a third-party plugin
    would be (their own modules, ``msquant.processors.*``, aside)."""
    found = {
        f"{path.relative_to(REPO)}:{line}: {problem}"
        for path in sorted((REPO / "processors").rglob("*.py"))
        for line, problem in _private_uses(ast.parse(path.read_text(encoding="utf-8")))
    }
    assert sorted(found) == []


def test_the_processor_check_catches_an_engine_import() -> None:
    """The checker itself: an engine submodule, a name outside ``__all__`` and a private
    attribute are each reported; the public spellings are not."""
    source = (
        "import msquant\n"
        "import msquant.plugin\n"
        "from msquant import quantize\n"
        "from msquant.plugin import Processor\n"
        "from msquant.processors.methods.options import GroupSize\n"
        "from msquant.quant.int_quant import qrange\n"
        "from msquant.plugin import build_config_model\n"
        "x = msquant.plugin.Saver, msquant.__version__, msquant.render_plan\n"
    )
    problems = [problem for _, problem in _private_uses(ast.parse(source))]
    assert problems == [
        "from msquant.quant.int_quant import qrange",
        "from msquant.plugin import build_config_model",
        "msquant.render_plan",
    ]


def test_no_engine_module_imports_a_facade() -> None:
    """The engine imports the modules under the facades, never the facades themselves: that is
    what keeps ``msquant.plugin`` (which imports every part of the engine) free of cycles."""
    graph = import_graph(REPO)
    offending = {
        module: sorted(targets & set(FACADES))
        for module, targets in graph.items()
        if module.startswith("msquant.")
        and not module.startswith("msquant.processors")
        and module not in FACADES
    }
    assert {module: facades for module, facades in offending.items() if facades} == {}


def _facade_origins(facade: object) -> dict[str, tuple[Path, str]]:
    """Public name -> (the file of the module it is imported from, its name there), read from
    the facade's own import statements."""
    source = Path(inspect.getfile(facade))  # type: ignore[arg-type]
    origins = {}
    for node in ast.parse(source.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.ImportFrom) and node.module:
            module = __import__(node.module, fromlist=["_"])
            for alias in node.names:
                origins[alias.asname or alias.name] = (Path(inspect.getfile(module)), alias.name)
    return origins


def _has_doc_comment(origin: tuple[Path, str]) -> bool:
    """Whether ``name`` is assigned at module level of ``path`` right below a ``#:`` comment
    (followed through a package that re-exports it from a module of its own)."""
    path, name = origin
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    for node in ast.parse(text).body:
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, ast.AnnAssign)
            else []
        )
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            return node.lineno > 1 and lines[node.lineno - 2].lstrip().startswith("#:")
        if (
            isinstance(node, ast.ImportFrom)
            and node.module
            and name in {a.name for a in node.names}
        ):
            module = __import__(node.module, fromlist=["_"])
            return _has_doc_comment((Path(inspect.getfile(module)), name))
    return False


def _private_uses(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, what) for every use of msquant outside its two public lists."""
    public = {"msquant": set(msquant.__all__), "msquant.plugin": set(msquant.plugin.__all__)}
    problems: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("msquant"):
            if node.module.startswith("msquant.processors"):
                continue
            names = [a.name for a in node.names]
            bad = [n for n in names if n not in public.get(node.module, set())]
            if bad:
                problems.append((node.lineno, f"from {node.module} import {', '.join(bad)}"))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("msquant") and alias.name not in public:
                    problems.append((node.lineno, f"import {alias.name}"))
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "msquant"
            and node.attr != "plugin"
            and node.attr not in public["msquant"]
        ):
            problems.append((node.lineno, f"msquant.{node.attr}"))
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Attribute)
            and isinstance(node.value.value, ast.Name)
            and node.value.value.id == "msquant"
            and node.value.attr == "plugin"
            and node.attr not in public["msquant.plugin"]
        ):
            problems.append((node.lineno, f"msquant.plugin.{node.attr}"))
    return sorted(problems)


def test_the_api_page_lists_every_public_name() -> None:
    """docs/api.md is the written promise: each name of both lists appears on it in backticks,
    with the two counts."""
    page = (REPO / "docs" / "api.md").read_text(encoding="utf-8")
    missing = [n for n in [*USER_API, *PLUGIN_API] if f"`{n}`" not in page]
    assert missing == []
    assert f"`msquant.__all__` ({len(USER_API)})" in page
    assert f"`msquant.plugin.__all__` ({len(PLUGIN_API)})" in page
