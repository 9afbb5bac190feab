"""vLLM-Ascend's own ``--quantization ascend`` code against msquant's W8A8, W8A8_DYNAMIC and
W4A8_DYNAMIC exports (msModelSlim's layout, issue 16).

``AscendModelSlimConfig`` (real, from the wheel) picks a scheme per vLLM module from
``quant_model_description.json`` and the scheme creates its parameters; every exported tensor
must fill one (names, dtypes, shapes; MoE experts included). What the NPU kernels compute is not
checked here. Opt-in (``-m consumers``).
"""

from __future__ import annotations

import dataclasses

import ascend_engine
import pytest
import torch
import vllm_engine
from act_cases import ASCEND_ACT, ASCEND_W4A8_GROUPED
from architectures import engine_modules
from cases import MOE_ARCHS
from exports import Export, ExportFactory
from loading import Resolution, loading_problems, read_tensor_table
from wheels import Release

pytestmark = [pytest.mark.consumers, pytest.mark.usefixtures("vllm_ascend")]

LINEAR = "AscendLinearMethod[{}]"
#: W8A8 (static) parameters the ``--quantization ascend`` path leaves unread: vLLM-Ascend's
#: ``AscendW8A8LinearMethod`` creates ``weight_scale`` / ``weight_offset`` but reads them only
#: for compressed-tensors checkpoints (``process_weights_after_loading``), and msModelSlim's
#: export does not store them.
W8A8_UNREAD = frozenset({"weight_scale", "weight_offset"})
#: W8A8 parameters filled by casting: msModelSlim stores ``input_offset`` as float32 ``[1]``,
#: vLLM-Ascend creates it int8 and its loader copies (``copy_`` casts the integral value).
W8A8_CAST = frozenset({"input_offset"})
#: MoE model types vLLM-Ascend 0.26 has no packed-module mapping for: it cannot find the experts'
#: description entries (``KeyError ...experts.weight``), whatever their scheme (consumers.md §1 #6);
#: 0.30 maps them.
UNMAPPED_MOE = {"0.26.0rc1": ("qwen2_moe", "mixtral"), "0.30.0rc2": ()}
#: How each release refuses a dense W4A8_DYNAMIC layer written per-channel (msquant's only
#: W4A8 layout): 0.26's deprecated linear scheme divides by the description's group_size (0);
#: 0.30 removed the linear scheme.
DENSE_W4A8_REFUSAL = {
    "0.26.0rc1": "ZeroDivisionError",
    "0.30.0rc2": "quant_type=W4A8_DYNAMIC for layer_type=linear",
}


def ascend_check(export: Export) -> tuple[list[Resolution], list[str]]:
    modules = engine_modules(export.model_dir, "vllm")
    resolutions = ascend_engine.resolve_export(export.path, export.case.arch, modules)
    resolutions = [
        dataclasses.replace(r, optional=W8A8_UNREAD, cast=W8A8_CAST)
        if r.method == LINEAR.format("AscendW8A8LinearMethod")
        else r
        for r in resolutions
    ]
    return resolutions, loading_problems(resolutions, read_tensor_table(export.path))


@pytest.mark.parametrize(
    ("name", "scheme", "served"),
    [
        # deq_scale: float32 for a bfloat16 model, int64 (float32 bits) otherwise, the dtypes
        # vLLM-Ascend creates when serving in bfloat16 / float16
        ("ascend_w8a8_static_sym_bf16", "AscendW8A8LinearMethod", torch.bfloat16),
        ("ascend_w8a8_static_asym_bf16", "AscendW8A8LinearMethod", torch.bfloat16),
        ("ascend_w8a8_static_sym", "AscendW8A8LinearMethod", torch.float16),
        ("ascend_w8a8_static_asym", "AscendW8A8LinearMethod", torch.float16),
        ("ascend_w8a8_dynamic", "AscendW8A8DynamicLinearMethod", torch.bfloat16),
    ],
)
def test_dense_w8a8_schemes_load_in_vllm_ascend(
    name: str,
    scheme: str,
    served: torch.dtype,
    make_export: ExportFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(vllm_engine, "PARAMS_DTYPE", served)
    resolutions, problems = ascend_check(make_export(ASCEND_ACT[name]))
    assert problems == []
    linear = [r for r in resolutions if r.module.kind == "linear"]
    assert len(linear) == 8 and all(r.method == LINEAR.format(scheme) for r in linear)
    if scheme == "AscendW8A8LinearMethod":
        params = linear[0].params
        assert {"weight", "input_scale", "input_offset", "deq_scale", "quant_bias"} <= set(params)
        expected = torch.float32 if served == torch.bfloat16 else torch.int64
        assert params["deq_scale"].dtype == expected


def test_float32_models_w8a8_deq_scale_does_not_fit_bfloat16_serving(
    make_export: ExportFactory,
) -> None:
    """msModelSlim's (and msquant's) int64 deq_scale of a float32 model fits vLLM-Ascend's
    float16 serving only; bfloat16 serving creates a float32 parameter."""
    _, problems = ascend_check(make_export(ASCEND_ACT["ascend_w8a8_static_sym"]))
    assert problems and all("deq_scale" in p and "I64" in p for p in problems), problems


@pytest.mark.parametrize("arch", MOE_ARCHS)
@pytest.mark.parametrize("weights", ["w8a8", "w4a8"])
def test_moe_dynamic_schemes_load_in_vllm_ascend(
    arch: str, weights: str, make_export: ExportFactory, vllm_ascend: Release
) -> None:
    export = make_export(ASCEND_ACT[f"ascend_{weights}_dynamic_moe_{arch}"])
    resolutions, problems = ascend_check(export)
    experts = [r for r in resolutions if r.module.kind == "experts"]
    assert experts
    expected = {
        "w8a8": "AscendW8A8DynamicFusedMoEMethod",
        "w4a8": "AscendW4A8DynamicFusedMoEMethod",
    }
    if arch in UNMAPPED_MOE[vllm_ascend.version]:  # consumers.md §1 #6, whatever the scheme
        assert all("KeyError" in (r.error or "") for r in experts)
        return
    assert all(expected[weights] in (r.method or "") for r in experts), [r.method for r in experts]
    if weights == "w8a8":
        assert problems == []
    else:  # vLLM-Ascend has no dense W4A8_DYNAMIC scheme: only the experts load (msquant warns)
        dense = [p for p in problems if ".experts" not in p]
        refusal = DENSE_W4A8_REFUSAL[vllm_ascend.version]
        assert dense and all(refusal in p for p in dense), dense
        assert not [p for p in problems if ".experts" in p]
        assert export.warned("W4A8_DYNAMIC", "vLLM-Ascend")


def test_dense_w4a8_is_refused_by_vllm_ascend_and_msquant_warns(
    make_export: ExportFactory, vllm_ascend: Release
) -> None:
    export = make_export(ASCEND_ACT["ascend_w4a8_dynamic"])
    resolutions, _ = ascend_check(export)
    linear = [r for r in resolutions if r.module.kind == "linear"]
    refusal = DENSE_W4A8_REFUSAL[vllm_ascend.version]
    assert linear and all(refusal in (r.error or "") for r in linear)
    assert export.warned("W4A8_DYNAMIC", "vLLM-Ascend", "0.30.0rc2 removed", "0.26.0rc1")


def test_w4a8_experts_beside_per_group_layers(
    make_export: ExportFactory, vllm_ascend: Release
) -> None:
    """The global ``group_size`` (32, from per-group W8A16 attention) is read as the W4A8
    experts' own: 0.30 refuses them, 0.26 builds per-group experts whose second-level scales
    the export does not have; msquant warns, naming both releases."""
    export = make_export(ASCEND_W4A8_GROUPED)
    resolutions, problems = ascend_check(export)
    experts = [r for r in resolutions if r.module.kind == "experts"]
    assert experts
    if vllm_ascend.version == "0.30.0rc2":
        assert all("no longer supported" in (r.error or "") for r in experts), experts
    else:
        assert all("AscendW4A8DynamicFusedMoEMethod" in (r.method or "") for r in experts)
        lacking = [p for p in problems if ".experts.w13_weight_scale_second" in p]
        assert len(lacking) == len(experts) and all("the export lacks" in p for p in lacking)
    assert export.warned("global group_size", "0.30.0rc2 refuses them", "0.26.0rc1")
