"""The public API, split by audience (issue 15 point 6): ``msquant`` for users, ``msquant.plugin``
for processor, method, format and model-adapter authors (docs/api.md), the latter a thin facade
(at most 60 names, issue 26) with the rest of the plugin API in sub-namespaces
(``msquant.plugin.numerics``, ...).

The ``__all__`` lists below are the promise: a name added or removed is a change of the
public API and must be made here and in docs/api.md on purpose. Every promised name is
documented, nothing else is importable from a facade, the built-in processors use only
these names (as a third-party plugin would), and no engine module imports a facade.
"""

from __future__ import annotations

import ast
import inspect
import shutil
import subprocess
from pathlib import Path

import pytest
from import_graph import import_graph, is_facade, module_files

import msquant
import msquant.plugin
import msquant.plugin.checks
import msquant.plugin.devices
import msquant.plugin.export
import msquant.plugin.model
import msquant.plugin.numerics
import msquant.plugin.planning
import msquant.plugin.reading

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

#: ``msquant.plugin``: the contracts a plugin implements or receives (at most 60 names).
PLUGIN_API = [
    # processors and their registry
    *("Processor", "ProcessorConfig", "ProcessorConfigList", "ProcessorContainer"),
    *("OutputHeadUser", "ProcessorRegistry", "default_registry", "ENTRY_POINT_GROUP"),
    # savers
    *("Saver", "SaverConfig", "SaverState", "SAVER_STATE_FORMAT", "NameSet"),
    # quantization methods and the schemes they are given
    *("QuantMethod", "MethodOptions", "MethodRegistry", "CalibratedQuantizer"),
    *("default_method_registry", "METHOD_ENTRY_POINT_GROUP", "BaseScheme", "ResolvedScheme"),
    "DynamicRule",
    # export formats: registry, reader contract, what a reader reports
    *("ExportFormat", "FormatRegistry", "default_formats", "FORMAT_ENTRY_POINT_GROUP"),
    *("ExportReader", "DecodedLayer", "LayerReport", "Findings"),
    # the run a processor takes part in, and the run report's records
    *("RunContext", "CalibrationSize", "Distributed", "SINGLE", "TransformLog"),
    *("TransformedExport", "DecoderLayer", "ModuleReport", "KVCacheReport"),
    # model adapters
    *("ModelAdapter", "MODEL_ADAPTER_GROUP", "adapter_for"),
    # the quantized representation and the quantization settings of a linear layer
    *("QuantizedWeight", "QuantizedLinear", "ValueType", "LinearQConfig", "WeightQConfig"),
    *("ActQConfig", "QDType", "QScope", "ActivationQuant"),
    # errors a plugin raises or reports (also in msquant)
    *("MsquantError", "MsquantInputError", "ConfigError", "ConfigIssue", "QuantizationError"),
    *("RegistryError", "TransformCheckError", "ResumeError"),
]

#: The plugin API's sub-namespaces, ``msquant.plugin.<name>``: the rest of the plugin API.
PLUGIN_NAMESPACES = {
    "numerics": [
        *("OnlineMinMax", "HessianAccumulator", "relative_output_errors", "value_type_named"),
        *("pack_nibbles", "unpack_nibbles", "E8M0_BIAS", "e8m0_bytes", "e8m0_scale"),
        *("decode_deq_scale", "deq_scale"),
        *("encode_deq_scale", "quant_bias", "scale_bias", "pack_int4_rows", "unpack_int4_rows"),
        *("quantize_weight_minmax", "quantize_weight_hessian_clip", "hessian_clip_qparams"),
        *("GPTQQuantizer", "GPTQOptions", "WeightPerChannelGPTQ", "WeightPerGroupGPTQ"),
        *("GPTQResult", "gptq_quantize", "resolve_block_size", "check_weight", "divisors"),
        *("compute_qparams", "minmax_qparams", "MSEOptions", "mse_qparams", "mse_minmax_qparams"),
        *("quantize_codes", "dequantize", "qrange", "abs_column_max", "flex_scales"),
        *("fold_into_linear_columns", "fold_into_linear_rows", "fold_into_norm", "iter_scales"),
        *("iter_weight_stat", "ov_scales_max", "ov_scales_mean", "search_alpha_beta"),
        *("update_channel_max", "fuse_norm_into_linear", "hadamard_core_order", "is_power_of_two"),
        *("rotate_input", "rotate_output", "rotation_for", "DEFAULT_ROTATION_SEED"),
    ],
    "model": [
        *("ModelAdapterRegistry", "default_adapter_registry", "MoEInfo", "enough_expert_tokens"),
        *("DEFAULT_EXPERT_TOKEN_RATIO", "moe_routers", "OutputHeadStage", "find_output_head"),
        *("find_final_norm", "head_is_tied", "tied_head_message", "is_selected"),
        *("first_matching_pattern", "pattern_problem", "unmatched_patterns", "FUSED_SHARDS"),
        *("FusedGroup", "fused_groups", "engine_names", "expert_groups", "expert_group_problems"),
        *("parse_expert_linear", "fused_group_problems", "unknown_expert_modules"),
        *("RotationLayout", "LayerRotationLayout", "SUBGRAPH_TYPES", "SmoothingSubgraph"),
        *("SubgraphType", "NormForm", "NormLayout", "measure_norm_form", "norm_form_problem"),
        *("replace_module", "balanced_owners"),
    ],
    "planning": [
        *("build_plan", "check_plan", "analyse_plan", "ModelPlan", "PlanRow", "ModuleDecision"),
        *("ModulePlanner", "PlanReview", "PlanReviewer", "KVCachePlan", "KVCachePlanner"),
        *("DynamicOverrides", "FusedNameMismatch", "parse_dynamic", "resolve_module_scheme"),
        *("written_for_engine_name", "fused_name_mismatches", "BASE_SOURCE", "DYNAMIC_KEYS"),
        "GPTQ_ONLY_KEYS",
    ],
    "export": [
        *("StagedOutputDir", "ShardedSafetensorsWriter", "copy_model_files", "safe_file_stem"),
        *("hf_weights_writer", "unique_state_items", "write_hf_config", "pack_int32"),
        *("pack_int4_pairs", "packed_length", "__version__"),
    ],
    "reading": [
        *("detect_format", "TensorStore", "trivial_g_idx", "read_json", "module_of"),
        *("ties_word_embeddings", "read_model_config", "hf_quant_method", "hf_export_format"),
        *("open_weights", "weight_files_present", "unpack_int32_stream", "unpack_int4_pairs"),
        "words_needed",
    ],
    "checks": [
        *("TransformProbe", "FlowPair", "prove_flow", "ov_channel_map", "FunctionCheck"),
        *("layer_fingerprint", "LayerSnapshot", "shared_weight_problems", "function_tolerance"),
        *("max_relative_error", "in_float32", "tensor_sha256"),
    ],
    "devices": [
        *("Backend", "DeviceSpec", "get_backend", "parse_device"),
    ],
}
#: The most names ``msquant.plugin`` itself may hold (issue 26: a thin facade).
FACADE_LIMIT = 60


def test_the_user_api_is_the_promised_list() -> None:
    assert sorted(msquant.__all__) == sorted(USER_API)
    assert len(set(msquant.__all__)) == len(msquant.__all__) == 38


def test_the_plugin_api_is_the_promised_list() -> None:
    assert sorted(msquant.plugin.__all__) == sorted(PLUGIN_API)
    assert len(set(msquant.plugin.__all__)) == len(msquant.plugin.__all__) == 59
    assert len(msquant.plugin.__all__) <= FACADE_LIMIT


def test_each_plugin_namespace_is_its_promised_list() -> None:
    """``msquant.plugin.<name>`` for each sub-namespace; no name is promised twice, and the
    plugin API as a whole still holds every name the single facade held before issue 26 (205),
    and ``ResumeError`` and ``__version__``, which the built-in processors needed."""
    for name, promised in PLUGIN_NAMESPACES.items():
        namespace = _namespace(name)
        assert sorted(namespace.__all__) == sorted(promised), name
        assert len(set(namespace.__all__)) == len(namespace.__all__), name
    every = [*PLUGIN_API, *(n for names in PLUGIN_NAMESPACES.values() for n in names)]
    assert len(every) == len(set(every)) == 209


def _namespace(name: str) -> object:
    return getattr(msquant.plugin, name)


def _facades() -> list[object]:
    return [msquant, msquant.plugin, *(_namespace(n) for n in PLUGIN_NAMESPACES)]


def _public() -> dict[str, set[str]]:
    """Module name -> its promised names, for every facade."""
    return {f.__name__: set(f.__all__) for f in _facades()}  # type: ignore[attr-defined]


def test_the_facades_hold_nothing_but_their_lists() -> None:
    """No leftover name (no compatibility shim): what is not in ``__all__`` is not importable
    from a facade, apart from its subpackages and the ``plugin`` facade inside ``msquant``."""
    for facade in _facades():
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
    for facade in _facades():
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
        "from msquant.plugin.numerics import qrange, Saver\n"
        "from msquant.plugin import quantize_weight_minmax\n"
        "x = msquant.plugin.Saver, msquant.__version__, msquant.render_plan\n"
        "y = msquant.plugin.numerics.qrange, msquant.plugin.model.qrange, msquant.plugin.qrange\n"
    )
    problems = [problem for _, problem in _private_uses(ast.parse(source))]
    assert problems == [
        "from msquant.quant.int_quant import qrange",
        "from msquant.plugin import build_config_model",
        "from msquant.plugin.numerics import Saver",
        "from msquant.plugin import quantize_weight_minmax",
        "msquant.render_plan",
        "msquant.plugin.model.qrange",
        "msquant.plugin.qrange",
    ]


def test_the_processors_ruff_rule_bans_every_import_outside_the_plugin_api() -> None:
    """``processors/ruff.toml`` bans (flake8-tidy-imports ``banned-api``) every first-level part
    of msquant but ``plugin`` and ``processors``, and every name of the user API, so that
    ``ruff check`` refuses an engine or root import in ``processors/`` as it is written."""
    tomllib = pytest.importorskip("tomllib")
    config = tomllib.loads((REPO / "processors" / "ruff.toml").read_text(encoding="utf-8"))
    assert config["extend"] == "../pyproject.toml"
    banned = set(config["lint"]["flake8-tidy-imports"]["banned-api"])
    parts = {m.split(".")[1] for m in module_files(REPO) if m.count(".") >= 1}
    expected = {f"msquant.{p}" for p in parts - {"plugin", "processors"}}
    expected |= {f"msquant.{name}" for name in msquant.__all__} | {"processors"}
    assert sorted(banned) == sorted(expected)


def test_ruff_refuses_an_engine_import_in_processors() -> None:
    """The rule itself, run by ruff on a file it takes for one of ``processors/``: the root
    package's names and engine modules are refused, the plugin API and the processors' own
    modules are not."""
    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed")
    source = (
        "from msquant import ConfigIssue\n"
        "from msquant.quant.int_quant import qrange\n"
        "import msquant.run.steps\n"
        "from msquant.plugin import QuantizationError\n"
        "from msquant.plugin.numerics import quantize_codes\n"
        "from msquant.processors.methods.options import GroupSize\n"
        "print(ConfigIssue, qrange, msquant.run.steps, QuantizationError, quantize_codes, GroupSize)\n"
    )
    result = subprocess.run(
        [ruff, "check", "--no-cache", "--select", "TID251", "--output-format", "concise"]
        + ["--stdin-filename", str(REPO / "processors" / "_banned_sample.py"), "-"],
        input=source,
        capture_output=True,
        text=True,
        cwd=REPO,
        check=False,
    )
    found = [
        (int(line.split(":")[1]), line.split("`")[1])
        for line in result.stdout.splitlines()
        if "TID251" in line
    ]
    assert found == [
        (1, "msquant.ConfigIssue"),
        (2, "msquant.quant"),
        (3, "msquant.run"),
        (7, "msquant.run"),  # the use of the module imported on line 3
    ], result.stdout + result.stderr


def test_no_engine_module_imports_a_facade() -> None:
    """The engine imports the modules under the facades, never the facades themselves: that is
    what keeps ``msquant.plugin`` (which imports every part of the engine) free of cycles."""
    graph = import_graph(REPO)
    offending = {
        module: sorted(t for t in targets if is_facade(t))
        for module, targets in graph.items()
        if module.startswith("msquant.")
        and not module.startswith("msquant.processors")
        and not is_facade(module)
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
    public = _public()
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
        elif isinstance(node, ast.Attribute) and (owner := _dotted(node.value)) in public:
            if owner == "msquant" and node.attr == "plugin":
                continue
            if owner == "msquant.plugin" and node.attr in PLUGIN_NAMESPACES:
                continue
            if owner != "msquant" and node.attr not in public[owner]:
                problems.append((node.lineno, f"{owner}.{node.attr}"))
    return sorted(problems)


def _dotted(node: ast.expr) -> str | None:
    """``a.b.c`` for a chain of attributes on a name, None for anything else."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and (owner := _dotted(node.value)):
        return f"{owner}.{node.attr}"
    return None


def test_the_api_page_lists_every_public_name() -> None:
    """docs/api.md is the written promise: each name of every list appears on it in backticks,
    with the counts of the two facades and a heading per plugin sub-namespace."""
    page = (REPO / "docs" / "api.md").read_text(encoding="utf-8")
    namespaced = [n for names in PLUGIN_NAMESPACES.values() for n in names]
    missing = [n for n in [*USER_API, *PLUGIN_API, *namespaced] if f"`{n}`" not in page]
    assert missing == []
    assert f"`msquant.__all__` ({len(USER_API)})" in page
    assert f"`msquant.plugin.__all__` ({len(PLUGIN_API)})" in page
    for name, names in PLUGIN_NAMESPACES.items():
        assert f"### `msquant.plugin.{name}` ({len(names)})" in page, name
