"""vLLM-Ascend's own ``--quantization ascend`` code against msquant's msModelSlim-format exports.

``AscendModelSlimConfig`` reads ``quant_model_description.json`` (the real ``maybe_update_config``),
picks a scheme per vLLM module from the shards' types (``get_quant_method``) and the scheme
creates its parameters (``AscendLinearMethod.create_weights``). What a scheme's NPU kernel
computes (``npu_weight_quant_batchmatmul``) cannot be checked here. Opt-in (``-m consumers``).
"""

from __future__ import annotations

import ascend_engine
import pytest
from architectures import engine_modules
from cases import ASCEND, MOE_ARCHS
from exports import Export, ExportFactory
from loading import Resolution, loading_problems, read_tensor_table

pytestmark = [pytest.mark.consumers, pytest.mark.usefixtures("vllm_ascend")]


def ascend_check(export: Export) -> tuple[list[Resolution], list[str]]:
    modules = engine_modules(export.model_dir, "vllm")
    resolutions = ascend_engine.resolve_export(export.path, export.case.arch, modules)
    return resolutions, loading_problems(resolutions, read_tensor_table(export.path))


@pytest.mark.parametrize("name", ["ascend_w8a16_sym", "ascend_w8a16_head"])
def test_w8a16_per_channel_loads_in_vllm_ascend(name: str, make_export: ExportFactory) -> None:
    resolutions, problems = ascend_check(make_export(ASCEND[name]))
    assert problems == []
    linear = [r for r in resolutions if r.module.kind == "linear"]
    assert all(r.method == "AscendLinearMethod[AscendW8A16LinearMethod]" for r in linear)
    head = next(r for r in resolutions if r.module.kind == "lm_head")
    expected = (
        "AscendEmbeddingMethod[AscendW8A16LinearMethod]"
        if "head" in name
        else "UnquantizedEmbeddingMethod"
    )
    assert head.method == expected


def test_w8a16_asym_loads_and_msquant_warns_about_the_offset_sign(
    make_export: ExportFactory,
) -> None:
    export = make_export(ASCEND["ascend_w8a16_asym"])
    resolutions, problems = ascend_check(export)
    assert problems == []  # the shapes load; the sign is a kernel question
    assert export.warned("offset", "vLLM-Ascend")


def test_w8a16_per_group_does_not_fit_vllm_ascend_and_msquant_warns(
    make_export: ExportFactory,
) -> None:
    """vLLM-Ascend's W8A16 scheme is per-channel: its ``[out, 1]`` scale cannot take the
    export's ``[out, in/group]`` one, as msquant warns."""
    export = make_export(ASCEND["ascend_w8a16_per_group"])
    _, problems = ascend_check(export)
    assert any("weight_scale: engine shape [128, 1]" in p for p in problems), problems
    assert export.warned("per-group", "vLLM-Ascend")


def test_w4a16_linear_is_refused_by_vllm_ascend_and_msquant_warns(
    make_export: ExportFactory,
) -> None:
    export = make_export(ASCEND["ascend_w4a16"])
    resolutions, _ = ascend_check(export)
    linear = [r for r in resolutions if r.module.kind == "linear"]
    assert linear and all(
        "quant_type=W4A16 for layer_type=linear" in (r.error or "") for r in linear
    )
    assert export.warned("W4A16", "vLLM-Ascend")


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_w8a16_moe_is_refused_by_vllm_ascend_and_msquant_warns(
    arch: str, make_export: ExportFactory
) -> None:
    export = make_export(ASCEND[f"ascend_w8a16_moe_{arch}"])
    resolutions, _ = ascend_check(export)
    experts = [r for r in resolutions if r.module.kind == "experts"]
    assert experts and all(r.error for r in experts)
    attention = [r for r in resolutions if r.module.leaf in ("qkv_proj", "o_proj")]
    assert all(r.error is None for r in attention)
    assert export.warned("MoE", "vLLM-Ascend")
