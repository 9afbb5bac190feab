"""vLLM 0.33.0's own quantization code against msquant's GPTQ and compressed-tensors exports.

For every module vLLM builds (fused ``qkv_proj`` / ``gate_up_proj``, ``...experts``, routers,
``lm_head``) the real ``get_quant_method`` picks the method and the real ``create_weights`` makes
the parameters; their names, shapes and dtypes must be what the export holds. Opt-in
(``pytest -m consumers``): downloads the wheel once.
"""

from __future__ import annotations

import ast

import pytest
import vllm_engine
from architectures import MODEL_CLASSES, PACKED_MODULES, engine_modules
from cases import (
    CT_HEAD_SAME,
    CT_INT3,
    CT_SERVED,
    GPTQ_MOE_RULES,
    GPTQ_SERVED,
    GPTQ_UNSERVABLE,
    HEAD_MIXTRAL,
)
from exports import Export, ExportCase, ExportFactory
from loading import Resolution, loading_problems, read_tensor_table

pytestmark = [pytest.mark.consumers, pytest.mark.usefixtures("vllm")]


def vllm_check(export: Export) -> tuple[list[Resolution], list[str]]:
    """vLLM's resolution of every module of ``export`` and the loading problems found."""
    modules = engine_modules(export.model_dir, "vllm")
    resolutions = vllm_engine.resolve_export(export.path, export.case.arch, modules)
    return resolutions, loading_problems(resolutions, read_tensor_table(export.path))


def _by_prefix(resolutions: list[Resolution]) -> dict[str, Resolution]:
    return {r.module.prefix: r for r in resolutions}


@pytest.mark.parametrize("case", list(GPTQ_SERVED.values()), ids=list(GPTQ_SERVED))
def test_gptq_exports_load_in_vllm(case: ExportCase, make_export: ExportFactory) -> None:
    export = make_export(case)
    resolutions, problems = vllm_check(export)
    assert problems == []
    methods = _by_prefix(resolutions)
    assert methods["model.layers.0.self_attn.o_proj"].method == "AutoGPTQLinearMethod"
    head = methods["lm_head"]
    assert head.quantized == case.lm_head, head.method
    if case.name == "gptq_neg_rules_only":
        assert methods["model.layers.0.mlp.down_proj"].method == "UnquantizedLinearMethod"
    if case.arch != "llama":
        experts = [r for r in resolutions if r.module.kind == "experts"]
        assert experts and all(r.method == "AutoGPTQMoEMethod" for r in experts)


@pytest.mark.parametrize("case", list(GPTQ_MOE_RULES.values()), ids=list(GPTQ_MOE_RULES))
def test_gptq_moe_experts_with_rules_load_in_vllm(
    case: ExportCase, make_export: ExportFactory
) -> None:
    resolutions, problems = vllm_check(make_export(case))
    assert problems == []
    layer1 = next(
        r
        for r in resolutions
        if r.module.prefix.startswith("model.layers.1.") and r.module.kind == "experts"
    )
    if "float" in case.name:
        assert layer1.method == "UnquantizedFusedMoEMethod"


@pytest.mark.parametrize("case", list(GPTQ_UNSERVABLE.values()), ids=list(GPTQ_UNSERVABLE))
def test_gptq_vllm_refuses_loudly_and_msquant_warns(
    case: ExportCase, make_export: ExportFactory
) -> None:
    """vLLM 0.33 has no GPTQ kernel for asymmetric or 3-bit weights: its config refuses the
    export, and msquant said so when it wrote it."""
    export = make_export(case)
    with pytest.raises(ValueError, match="Unsupported quantization config"):
        vllm_engine.quant_config_for(export.path, case.arch)
    assert export.warned("vLLM", "compressed_tensors")


@pytest.mark.parametrize(
    "case",
    [case for case in CT_SERVED.values()],
    ids=list(CT_SERVED),
)
def test_compressed_tensors_exports_load_in_vllm(
    case: ExportCase, make_export: ExportFactory
) -> None:
    resolutions, problems = vllm_check(make_export(case))
    assert problems == []
    methods = _by_prefix(resolutions)
    assert methods["lm_head"].quantized == case.lm_head
    experts = {r.module.prefix: r.method for r in resolutions if r.module.kind == "experts"}
    for prefix, method in experts.items():
        float_layer = "float_experts" in case.name and prefix.startswith("model.layers.1.")
        assert method == (
            "UnquantizedFusedMoEMethod" if float_layer else "CompressedTensorsWNA16MoEMethod"
        )


def test_qwen3_moe_router_is_ignored_for_vllm(make_export: ExportFactory) -> None:
    resolutions, problems = vllm_check(make_export(CT_SERVED["ct_moe_qwen3_moe"]))
    assert problems == []
    gates = [r for r in resolutions if r.module.leaf == "gate"]
    assert gates and all(r.method == "UnquantizedLinearMethod" for r in gates)


def test_compressed_tensors_head_in_base_scheme_loads_in_vllm(make_export: ExportFactory) -> None:
    resolutions, problems = vllm_check(make_export(CT_HEAD_SAME))
    assert problems == []
    assert _by_prefix(resolutions)["lm_head"].method == "CompressedTensorsLinearMethod"


def test_compressed_tensors_int3_loads_in_vllm(make_export: ExportFactory) -> None:
    """vLLM's WNA16 scheme takes 2-8 bits; the shapes it creates for 3-bit fit the dense
    packing (whether its kernels compute them right needs a GPU)."""
    resolutions, problems = vllm_check(make_export(CT_INT3))
    assert problems == []
    assert (
        _by_prefix(resolutions)["model.layers.0.mlp.down_proj"].method
        == "CompressedTensorsLinearMethod"
    )


def test_compressed_tensors_int3_warns_about_vllms_pin(make_export: ExportFactory) -> None:
    pin = vllm_engine.load_vllm().requirement("compressed-tensors")
    assert pin is not None and "0.17" in pin, pin
    assert make_export(CT_INT3).warned("compressed-tensors", "0.18")


@pytest.mark.parametrize("arch", sorted(PACKED_MODULES))
def test_module_templates_match_vllms_packed_modules(arch: str) -> None:
    """The fused names the harness walks are vLLM's own ``packed_modules_mapping`` (read from the
    model class in the wheel, without importing it)."""
    source = vllm_engine.load_vllm()
    files = {"mistral": "llama", "deepseek_v3": "deepseek_v2"}
    path = source.path_of(f"vllm/model_executor/models/{files.get(arch, arch)}.py")
    tree = ast.parse(path.read_text())
    wanted = "LlamaForCausalLM" if arch == "mistral" else MODEL_CLASSES[arch]
    if arch == "deepseek_v3":
        wanted = "DeepseekV2ForCausalLM"  # DeepseekV3ForCausalLM only renames it
    mapping = _class_packed_mapping(tree, wanted)
    expected = {key: list(value) for key, value in PACKED_MODULES[arch].items()}
    if arch == "deepseek_v3":
        # added in __init__ when q_lora_rank is set
        assert '"fused_qkv_a_proj"' in path.read_text()
        mapping["fused_qkv_a_proj"] = ["q_a_proj", "kv_a_proj_with_mqa"]
    if arch in ("qwen3_moe", "qwen2_moe"):
        mapping.pop("experts", None)
        mapping.setdefault("gate_up_proj", ["gate_proj", "up_proj"])  # added in __init__
    assert mapping == expected


def _class_packed_mapping(tree: ast.Module, class_name: str) -> dict[str, list[str]]:
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            for statement in node.body:
                if isinstance(statement, ast.Assign) and any(
                    getattr(t, "id", None) == "packed_modules_mapping" for t in statement.targets
                ):
                    return dict(ast.literal_eval(statement.value))
    raise AssertionError(f"{class_name}.packed_modules_mapping not found")


@pytest.mark.parametrize("fmt", sorted(HEAD_MIXTRAL))
def test_quantized_mixtral_head_loads_in_vllm(fmt: str, make_export: ExportFactory) -> None:
    """vLLM's MixtralForCausalLM passes the quantization config to its head (SGLang's does not,
    see test_sglang.py)."""
    resolutions, problems = vllm_check(make_export(HEAD_MIXTRAL[fmt]))
    assert problems == []
    assert _by_prefix(resolutions)["lm_head"].quantized
