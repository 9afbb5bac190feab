"""SGLang 0.5.23's own quantization code against msquant's GPTQ and compressed-tensors exports.

For every module SGLang builds (fused ``qkv_proj`` / ``gate_up_proj``, DeepSeek's
``fused_qkv_a_proj_with_mqa``, ``...experts``, routers, the real ``ParallelLMHead``), the real
config chosen through SGLang's registry picks the method (``get_quant_method``, with SGLang's own
``dynamic`` matching) and the real ``create_weights`` makes the parameters; their names, shapes
and dtypes must be what the export holds, as SGLang's loaders combine the tensors. Opt-in
(``pytest -m consumers``): downloads the wheel once.
"""

from __future__ import annotations

import ast
import re

import pytest
import sglang_engine
from architectures import SGLANG_PACKED_MODULES, engine_modules
from cases import (
    CT_HEAD_SAME,
    CT_INT3,
    CT_SERVED,
    GPTQ_INT3_MLP,
    GPTQ_MOE_RULES,
    GPTQ_SERVED,
    GPTQ_UNSERVABLE,
    HEAD_MIXTRAL,
)
from exports import Export, ExportCase, ExportFactory
from loading import Resolution, loading_problems, read_tensor_table

import msquant

pytestmark = pytest.mark.consumers

#: Findings of this suite that SGLang's code, not msquant's export, decides (see docs/formats.md):
#: DeepSeek's q_a_proj + kv_a_proj_with_mqa concatenated along dimension 0 by SGLang's loader.
DEEPSEEK_A_PROJ = "fused_qkv_a_proj_with_mqa"


def sglang_check(export: Export) -> tuple[list[Resolution], list[str]]:
    """SGLang's resolution of every module of ``export`` and the loading problems found."""
    modules = engine_modules(export.model_dir, "sglang")
    resolutions = sglang_engine.resolve_export(export.path, export.case.arch, modules)
    return resolutions, loading_problems(resolutions, read_tensor_table(export.path))


def _by_prefix(resolutions: list[Resolution]) -> dict[str, Resolution]:
    return {r.module.prefix: r for r in resolutions}


def _experts(resolutions: list[Resolution], layer: int) -> Resolution:
    return next(
        r
        for r in resolutions
        if r.module.kind == "experts" and r.module.prefix.startswith(f"model.layers.{layer}.")
    )


# -- GPTQ: which config SGLang picks ---------------------------------------------------------------


def test_symmetric_4_and_8_bit_gptq_is_served_as_gptq_marlin(make_export: ExportFactory) -> None:
    """SGLang's registry has no plain ``gptq`` on CUDA: ``GPTQMarlinConfig``'s
    ``override_quantization_method`` claims the checkpoint when it is Marlin-compatible."""
    sglang_engine.load_sglang()
    from sglang.srt.layers.quantization.gptq.gptq import GPTQMarlinConfig

    for name in ("gptq_int4_g128", "gptq_int8_channel"):
        hf_config = sglang_engine.hf_quantization_config(make_export(GPTQ_SERVED[name]).path)
        assert GPTQMarlinConfig.is_gptq_marlin_compatible(hf_config)
        assert sglang_engine.detect_method(hf_config) == "gptq_marlin"


@pytest.mark.parametrize("name", sorted(GPTQ_UNSERVABLE))
def test_gptq_sglang_refuses_asym_and_3_bit_and_msquant_warns(
    name: str, make_export: ExportFactory
) -> None:
    """Asymmetric or 3-bit GPTQ is not Marlin-compatible, so the checkpoint keeps the name
    ``gptq``, which SGLang's registry offers only on NPU / CPU / XPU: on a GPU the config is
    refused. On those devices ``GPTQConfig``'s own bit check (2/3/4/8) accepts it."""
    export = make_export(GPTQ_UNSERVABLE[name])
    hf_config = sglang_engine.hf_quantization_config(export.path)
    assert sglang_engine.detect_method(hf_config) == "gptq"
    with pytest.raises(ValueError, match="Invalid quantization method: gptq"):
        sglang_engine.quant_config_for(export.path, export.case.arch)
    from sglang.srt.layers.quantization.gptq.gptq import GPTQConfig

    assert GPTQConfig.from_config(hf_config).weight_bits == hf_config["bits"]
    assert export.warned("SGLang", "4- or 8-bit symmetric")


def test_gptq_3_bit_rule_is_refused_per_layer_and_msquant_warns(
    make_export: ExportFactory,
) -> None:
    """A 4-bit base makes the checkpoint ``gptq_marlin``; SGLang's ``override_config`` then
    refuses the 3-bit layers the ``dynamic`` rule selects, and only those."""
    export = make_export(GPTQ_INT3_MLP)
    resolutions, _ = sglang_check(export)
    refused = {r.module.prefix for r in resolutions if r.error}
    assert refused == {"model.layers.1.mlp.gate_up_proj", "model.layers.1.mlp.down_proj"}
    assert all(
        "Unsupported quantization config: bits=3" in (r.error or "") for r in resolutions if r.error
    )
    assert export.warned("SGLang", "4- or 8-bit symmetric")


# -- GPTQ: linears, dynamic, heads, MoE ------------------------------------------------------------


@pytest.mark.parametrize(
    "case",
    [c for c in GPTQ_SERVED.values() if c.arch != "deepseek_v3"],
    ids=[n for n, c in GPTQ_SERVED.items() if c.arch != "deepseek_v3"],
)
def test_gptq_exports_load_in_sglang(case: ExportCase, make_export: ExportFactory) -> None:
    resolutions, problems = sglang_check(make_export(case))
    assert problems == []
    methods = _by_prefix(resolutions)
    assert methods["model.layers.0.self_attn.o_proj"].method == "GPTQMarlinLinearMethod"
    head = methods["lm_head"]
    assert head.method == (
        "GPTQMarlinLinearMethod" if case.lm_head else "UnquantizedEmbeddingMethod"
    )
    if case.name in ("gptq_neg_rules_only", "gptq_mixed"):
        # `-:` rule: SGLang has no metadata fallback, the rule alone keeps the layer float
        assert methods["model.layers.0.mlp.down_proj"].method == "UnquantizedLinearMethod"
    if case.name == "gptq_mixed":
        qweight = methods["model.layers.1.mlp.gate_up_proj"].params["qweight"]
        assert qweight.shape == (128 // 4, 2 * 256)  # the `+:` rule's 8 bits: 4 codes a word
    if case.name == "gptq_head_other_scheme":
        assert head.params["qweight"].shape == (128 // 4, 384)  # int8 per-channel head
    if case.arch != "llama":
        experts = [r for r in resolutions if r.module.kind == "experts"]
        assert experts and all(r.method == "GPTQMarlinMoEMethod" for r in experts)
        routers = [r for r in resolutions if r.module.leaf in ("gate", "shared_expert_gate")]
        assert routers and all(r.method == "UnquantizedLinearMethod" for r in routers)


def test_gptq_deepseek_a_projection_does_not_fit_sglangs_loader(
    make_export: ExportFactory,
) -> None:
    """SGLang fuses DeepSeek's q_a_proj and kv_a_proj_with_mqa into one ReplicatedLinear and
    concatenates the two checkpoint tensors along dimension 0 (AWQ and moe_wna16 excepted):
    GPTQ's ``[in / pack, out]`` tensors of different widths cannot be joined that way, and the
    joined ``g_idx`` is twice the parameter's length. Everything else of the export fits."""
    export = make_export(GPTQ_SERVED["gptq_moe_deepseek_v3"])
    resolutions, problems = sglang_check(export)
    assert problems and all(DEEPSEEK_A_PROJ in p for p in problems), problems
    assert any("qweight" in p and "do not allow" in p for p in problems)
    fused = _by_prefix(resolutions)[f"model.layers.0.self_attn.{DEEPSEEK_A_PROJ}"]
    assert fused.method == "GPTQMarlinLinearMethod"


@pytest.mark.parametrize("case", list(GPTQ_MOE_RULES.values()), ids=list(GPTQ_MOE_RULES))
def test_sglang_gptq_moe_ignores_dynamic_and_msquant_warns(
    case: ExportCase, make_export: ExportFactory
) -> None:
    """§1 #1: the export's rule for layer 1's experts matches the experts module's name under
    SGLang's own ``get_dynamic_override``, yet SGLang's MoE path never asks it: the experts are
    built in the base scheme and the export's tensors do not fill them. msquant said at quant
    time that SGLang cannot serve the checkpoint, and ``msquant verify`` says it too."""
    export = make_export(case)
    config = sglang_engine.quant_config_for(export.path, case.arch)
    resolutions, problems = sglang_check(export)
    layer1 = _experts(resolutions, 1)
    from sglang.srt.layers.quantization.utils import get_dynamic_override

    override = get_dynamic_override(config, layer1.module.prefix)
    float_experts = "float" in case.name
    assert override == (False if float_experts else {"bits": 8})
    assert layer1.method == "GPTQMarlinMoEMethod"
    hidden, width = layer1.module.input_size, layer1.module.output_sizes[0]
    assert layer1.params["w13_qweight"].shape == (4, hidden // 8, 2 * width)  # int4 slots
    expert_problems = [p for p in problems if p.startswith(layer1.module.prefix)]
    assert expert_problems
    expected = "the export lacks" if float_experts else "engine slot"
    assert any(expected in p for p in expert_problems), expert_problems
    assert export.warned("SGLang cannot serve this checkpoint")
    verify_warnings = msquant.verify_export(export.path).warnings
    assert any("SGLang" in w and "cannot serve the experts" in w for w in verify_warnings)


def test_sglang_builds_mixtrals_head_without_the_quantization_config(
    make_export: ExportFactory,
) -> None:
    """SGLang's MixtralForCausalLM passes no quantization config to its ParallelLMHead: a
    quantized Mixtral head is built float and its GPTQ / compressed-tensors tensors are not
    read (vLLM passes the config)."""
    for case in HEAD_MIXTRAL.values():
        resolutions, problems = sglang_check(make_export(case))
        head = _by_prefix(resolutions)["lm_head"]
        assert head.method == "UnquantizedEmbeddingMethod"
        assert problems and all(p.startswith("lm_head") for p in problems), problems
        assert any("lacks ['lm_head.weight']" in p for p in problems), problems


# -- compressed-tensors -----------------------------------------------------------------------------

#: compressed-tensors exports SGLang loads as they are (4 or 8 bits).
CT_LOADING = [
    name
    for name in CT_SERVED
    if name not in ("ct_mixed", "ct_float_qkv", "ct_moe_float_experts_mixtral")
    and "deepseek" not in name
]


@pytest.mark.parametrize("name", CT_LOADING)
def test_compressed_tensors_exports_load_in_sglang(name: str, make_export: ExportFactory) -> None:
    case = CT_SERVED[name]
    resolutions, problems = sglang_check(make_export(case))
    assert problems == []
    methods = _by_prefix(resolutions)
    assert methods["model.layers.0.self_attn.o_proj"].method == "CompressedTensorsLinearMethod"
    assert methods["lm_head"].method == (
        "CompressedTensorsLinearMethod" if case.lm_head else "UnquantizedEmbeddingMethod"
    )
    for resolution in resolutions:
        if resolution.module.kind == "experts":
            float_layer = "float_experts" in name and resolution.module.prefix.startswith(
                "model.layers.1."
            )
            assert resolution.method == (
                "UnquantizedFusedMoEMethod" if float_layer else "CompressedTensorsFusedMoEMethod"
            )


def test_compressed_tensors_head_in_base_scheme_loads_in_sglang(
    make_export: ExportFactory,
) -> None:
    """§1 #7: SGLang gives the head a scheme only when a target names it; msquant names it."""
    resolutions, problems = sglang_check(make_export(CT_HEAD_SAME))
    assert problems == []
    assert _by_prefix(resolutions)["lm_head"].method == "CompressedTensorsLinearMethod"


def test_qwen3_moe_router_is_float_in_sglang_either_way(make_export: ExportFactory) -> None:
    """SGLang builds Qwen3-MoE's router without the quantization config (ModelSlim excepted);
    were the config passed, as vLLM does, the router would still be float: msquant lists it in
    ``ignore``."""
    export = make_export(CT_SERVED["ct_moe_qwen3_moe"])
    resolutions, problems = sglang_check(export)
    assert problems == []
    gates = [r for r in resolutions if r.module.leaf == "gate"]
    assert gates and all(r.method == "UnquantizedLinearMethod" for r in gates)
    config = sglang_engine.quant_config_for(export.path, "qwen3_moe")
    for gate in gates:
        layer = sglang_engine.ReplicatedLinear(gate.module)
        with sglang_engine.cuda_device():
            method = config.get_quant_method(layer, prefix=gate.module.prefix)
        assert type(method).__name__ == "UnquantizedLinearMethod"


def test_compressed_tensors_int3_is_refused_by_sglang_and_msquant_warns(
    make_export: ExportFactory,
) -> None:
    """§1 #8: SGLang's WNA16 scheme takes 4 and 8 bits only; every 3-bit layer is refused."""
    export = make_export(CT_INT3)
    resolutions, _ = sglang_check(export)
    linear = [r for r in resolutions if r.module.kind == "linear"]
    assert linear and all("CompressedTensorsW4A16Sparse24" in (r.error or "") for r in linear), [
        r.error for r in linear
    ]
    sglang_engine.load_sglang()
    from sglang.srt.layers.quantization.compressed_tensors.schemes import WNA16_SUPPORTED_BITS

    assert WNA16_SUPPORTED_BITS == [4, 8]
    assert export.warned("SGLang 0.5.23 loads compressed-tensors weight-only layers of 4 or 8")


def test_compressed_tensors_fused_layers_in_their_own_group_take_sglangs_linear_scheme(
    make_export: ExportFactory,
) -> None:
    """SGLang's Llama (like its Qwen2/3, Mistral, Mixtral, Qwen2-MoE) declares no
    ``packed_modules_mapping``: a fused layer whose shards are named in a group of their own
    (layer 1's 8-bit MLP) is matched by the class target ``Linear`` instead, built 4-bit, and
    the 8-bit shards do not fit. Unfused layers (down_proj) resolve by name."""
    resolutions, problems = sglang_check(make_export(CT_SERVED["ct_mixed"]))
    methods = _by_prefix(resolutions)
    gate_up = methods["model.layers.1.mlp.gate_up_proj"]
    assert gate_up.params["weight_packed"].shape == (2 * 256, 128 // 8)  # 4-bit
    assert methods["model.layers.1.mlp.down_proj"].params["weight_packed"].shape == (128, 256 // 4)
    assert problems and all("model.layers.1.mlp.gate_up_proj" in p for p in problems), problems


def test_compressed_tensors_fused_layers_in_ignore_are_built_quantized_by_sglang(
    make_export: ExportFactory,
) -> None:
    """The same lookup for ``ignore``: layer 0's float q/k/v are listed by name, SGLang's Llama
    asks about ``qkv_proj``, finds no entry and builds it quantized; the float weights are not
    read."""
    resolutions, problems = sglang_check(make_export(CT_SERVED["ct_float_qkv"]))
    qkv = _by_prefix(resolutions)["model.layers.0.self_attn.qkv_proj"]
    assert qkv.method == "CompressedTensorsLinearMethod"
    assert problems and all(p.startswith(qkv.module.prefix) for p in problems), problems
    assert any("lacks" in p and "q_proj.weight_packed" in p for p in problems)


def test_compressed_tensors_mixtral_float_experts_are_not_seen_by_sglang(
    make_export: ExportFactory,
) -> None:
    """SGLang decides an experts module's compressed-tensors scheme from the names
    ``<experts>.0.gate_proj`` / ``up_proj`` / ``down_proj``; Mixtral's experts are ``w1`` /
    ``w3`` / ``w2``, so ignoring them by name does not reach SGLang: it builds quantized experts
    and the float weights are not read. (Qwen-style names work: the other archs load.)"""
    resolutions, problems = sglang_check(make_export(CT_SERVED["ct_moe_float_experts_mixtral"]))
    layer1 = _experts(resolutions, 1)
    assert layer1.method == "CompressedTensorsFusedMoEMethod"
    assert problems and all(p.startswith(layer1.module.prefix) for p in problems), problems
    assert any("lacks" in p and ".w1.weight_packed" in p for p in problems)


@pytest.mark.parametrize("name", ["ct_moe_deepseek_v3", "ct_moe_float_experts_deepseek_v3"])
def test_compressed_tensors_deepseek_a_projection_weight_shape_does_not_fit_sglangs_loader(
    name: str, make_export: ExportFactory
) -> None:
    """SGLang's DeepSeek loader joins q_a_proj's and kv_a_proj_with_mqa's tensors along
    dimension 0: packed weights and scales fit (their output dimension is 0), the two
    ``weight_shape`` vectors do not (``[4]`` against the parameter's ``[2]``)."""
    _, problems = sglang_check(make_export(CT_SERVED[name]))
    assert problems and all(DEEPSEEK_A_PROJ in p and "weight_shape" in p for p in problems), (
        problems
    )


# -- what the harness assumes about SGLang's models ---------------------------------------------


def _class_attribute(tree: ast.Module, class_name: str, attribute: str) -> object:
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            for statement in node.body:
                if isinstance(statement, ast.Assign) and any(
                    getattr(t, "id", None) == attribute for t in statement.targets
                ):
                    return ast.literal_eval(statement.value)
            return None
    raise AssertionError(f"{class_name} not found")


@pytest.mark.parametrize("arch", sorted(SGLANG_PACKED_MODULES))
def test_packed_modules_match_sglangs_model_classes(arch: str) -> None:
    """The fused names the harness gives SGLang's configs are the model classes' own
    ``packed_modules_mapping`` (read from the wheel, without importing the model files)."""
    source = sglang_engine.load_sglang()
    files = {"deepseek_v3": ("deepseek_v2", "DeepseekV2ForCausalLM")}
    classes = {
        "llama": ("llama", "LlamaForCausalLM"),
        "qwen3_moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
        "qwen2_moe": ("qwen2_moe", "Qwen2MoeForCausalLM"),
        "mixtral": ("mixtral", "MixtralForCausalLM"),
        **files,
    }
    module, cls = classes[arch]
    text = source.path_of(f"sglang/srt/models/{module}.py").read_text()
    mapping = _class_attribute(ast.parse(text), cls, "packed_modules_mapping") or {}
    assert isinstance(mapping, dict)
    expected = {k: list(v) for k, v in SGLANG_PACKED_MODULES[arch].items()}
    if arch == "deepseek_v3":
        # added in __init__ when q_lora_rank is set (the harness's DeepSeek model sets it)
        assert 'self.packed_modules_mapping["fused_qkv_a_proj_with_mqa"]' in text
        mapping["fused_qkv_a_proj_with_mqa"] = ["q_a_proj", "kv_a_proj_with_mqa"]
    assert mapping == expected


def test_sglang_model_files_build_routers_and_heads_as_the_harness_does() -> None:
    """Qwen3-MoE's router gets a quantization config only for ModelSlim checkpoints; Mixtral's
    head gets none; DeepSeek's loader joins the a-projections along dimension 0 except for
    AWQ and moe_wna16."""
    source = sglang_engine.load_sglang()
    qwen3 = source.path_of("sglang/srt/models/qwen3_moe.py").read_text()
    assert re.search(
        r"gate_quant_config = \(\s*quant_config\s*if \(quant_config is not None and "
        r'quant_config.get_name\(\) == "modelslim"\)\s*else None\s*\)',
        qwen3,
    )
    mixtral = source.path_of("sglang/srt/models/mixtral.py").read_text()
    assert re.search(
        r"self.lm_head = ParallelLMHead\(\s*config.vocab_size, config.hidden_size, "
        r'prefix=add_prefix\("lm_head", prefix\)\s*\)',
        mixtral,
    )
    loader = source.path_of("sglang/srt/models/deepseek_common/deepseek_weight_loader.py")
    text = loader.read_text()
    assert "cat_dim = 0" in text and "torch.cat(\n" in text
    assert re.search(r'get_name\(\) == "moe_wna16"\s*\):\s*cat_dim = 1', text)


# -- msquant warns about these SGLang limits (processors/sglang_limits.py) -----------------------


@pytest.mark.parametrize("fmt", sorted(HEAD_MIXTRAL))
def test_msquant_warns_that_sglang_builds_a_quantized_mixtral_head_float(
    fmt: str, make_export: ExportFactory
) -> None:
    assert make_export(HEAD_MIXTRAL[fmt]).warned("SGLang", "Mixtral", "lm_head")


@pytest.mark.parametrize("name", ["gptq_moe_deepseek_v3", "ct_moe_deepseek_v3"])
def test_msquant_warns_that_sglang_cannot_load_quantized_deepseek_a_projections(
    name: str, make_export: ExportFactory
) -> None:
    case = {**GPTQ_SERVED, **CT_SERVED}[name]
    assert make_export(case).warned("SGLang", "kv_a_proj_with_mqa", "concatenat")


def test_msquant_warns_that_sglang_does_not_see_float_mixtral_experts(
    make_export: ExportFactory,
) -> None:
    export = make_export(CT_SERVED["ct_moe_float_experts_mixtral"])
    assert export.warned("SGLang", "experts", "w1")


@pytest.mark.parametrize(
    ("name", "fused"), [("ct_mixed", "gate_up_proj"), ("ct_float_qkv", "qkv_proj")]
)
def test_msquant_warns_that_sglang_gives_fused_layers_the_linear_scheme(
    name: str, fused: str, make_export: ExportFactory
) -> None:
    assert make_export(CT_SERVED[name]).warned("SGLang", fused)
