"""vLLM-Ascend's own ``--quantization compressed-tensors`` code against msquant's MX exports.

The real ``AscendCompressedTensorsConfig`` (``from_config`` on ``config.json``'s
``quantization_config``, ``get_quant_method``) is asked about every module of the W8A8_MXFP8
(``mxfp8-quantized``) and W4A4_MXFP4 (``mxfp4-pack-quantized``) exports of a tiny Llama, and the
scheme it picks creates its parameters (``AscendLinearMethod.create_weights`` over the real
``AscendW8A8MXFP8DynamicLinearMethod`` / ``AscendW4A4MXFP4DynamicLinearMethod``): every exported
tensor must fill one (name, shape, dtype).

0.30.0rc2 picks ``W8A8_MXFP8`` / ``W4A4_MXFP4`` for every linear, fused q/k/v and gate/up
included (``quantization/configs/compressed_tensors_config.py:346-364``), because the export's
top-level ``format`` is ``mixed-precision`` (with the group's own format ``mxfp8-quantized``, it
would drop the input activations, ``:128-138``, and refuse every layer). 0.26.0rc1 refuses them,
as msquant warns. Not checked on a CPU: the NPU kernels (``npu_dynamic_mx_quant``,
``npu_quant_matmul``) and ``process_weights_after_loading`` (NPU formats). Opt-in
(``pytest -m consumers``).
"""

from __future__ import annotations

import ascend_engine
import pytest
import torch
import vllm_engine
from act_cases import ActExportCase
from architectures import engine_modules
from exports import ExportFactory
from loading import loading_problems, read_tensor_table
from test_vllm_mx import CASES, mx, mx_linear_params, mx_moe_params, params_of
from wheels import Release

pytestmark = [pytest.mark.consumers, pytest.mark.usefixtures("vllm_ascend")]

#: export case name -> (the scheme vLLM-Ascend 0.30 registers for it, its weight parameter,
#: the weight's dtype, input columns per byte)
ASCEND_SCHEMES = {
    "ct_w8a8_mxfp8": ("AscendW8A8MXFP8DynamicLinearMethod", "weight", torch.float8_e4m3fn, 1),
    "ct_w4a4_mxfp4": ("AscendW4A4MXFP4DynamicLinearMethod", "weight_packed", torch.uint8, 2),
}
#: How vLLM-Ascend 0.26.0rc1 refuses each export's linears (consumers.ASCEND_MX_RELEASES).
REFUSAL_026 = {
    "ct_w8a8_mxfp8": "NotImplementedError: No compressed-tensors compatible quantization type",
    "ct_w4a4_mxfp4": "TypeError: AscendW4A8MXFPDynamicLinearMethod.__init__() got an unexpected "
    "keyword argument 'use_weight_packed'",
}
MX_CASES = [case for case, *_ in CASES]


@pytest.mark.parametrize("case", MX_CASES, ids=[case.name for case in MX_CASES])
def test_vllm_ascend_picks_the_mx_scheme_for_every_linear_and_every_tensor_loads(
    case: ActExportCase, make_export: ExportFactory, vllm_ascend: Release
) -> None:
    export = make_export(case)
    name = case.name
    modules = engine_modules(export.model_dir, "vllm")
    resolutions = ascend_engine.resolve_compressed_tensors_export(export.path, case.arch, modules)
    linear = [r for r in resolutions if r.module.kind == "linear"]
    assert len(linear) == 8  # 2 layers: qkv_proj, o_proj, gate_up_proj, down_proj
    assert export.warned("vLLM-Ascend", "0.26.0rc1 refuses them", "0.30.0rc2")
    if vllm_ascend.version == "0.26.0rc1":
        assert all(REFUSAL_026[name] in (r.error or "") for r in linear), [r.error for r in linear]
        return
    scheme, weight_name, weight_dtype, per_byte = ASCEND_SCHEMES[name]
    assert [r.error for r in resolutions if r.error] == []
    assert loading_problems(resolutions, read_tensor_table(export.path)) == []
    assert {r.method for r in linear} == {f"AscendLinearMethod[{scheme}]"}
    for resolution in linear:
        expected = mx_linear_params(resolution.module, weight_name, weight_dtype, per_byte)
        assert params_of(resolution) == expected
    # the MX group size the config recorded for the schemes (_detect_quant_type)
    config = vllm_engine.CURRENT_CONFIG.quant_config
    assert config.quant_description["group_size"] == 32
    head = next(r for r in resolutions if r.module.kind == "lm_head")
    assert not head.quantized


#: value type -> (vLLM-Ascend 0.30's MoE scheme, the experts' weight parameters' suffix, their
#: dtype, input columns per byte)
MOE_SCHEMES = {
    "mxfp8": ("AscendW8A8MXFP8DynamicFusedMoEMethod", "", torch.float8_e4m3fn, 1),
    "mxfp4": ("AscendW4A4MXFP4DynamicFusedMoEMethod", "_packed", torch.uint8, 2),
}
MOE_CASES = [
    ActExportCase(f"ct_{v}_moe_qwen3_moe", "qwen3_moe", "compressed_tensors", mx(v), act=mx(v))
    for v in MOE_SCHEMES
]


@pytest.mark.parametrize("case", MOE_CASES, ids=[case.name for case in MOE_CASES])
def test_vllm_ascend_picks_the_mx_moe_scheme_and_every_expert_tensor_loads(
    case: ActExportCase, make_export: ExportFactory, vllm_ascend: Release
) -> None:
    """Qwen3-MoE, every linear MX (the router stays float, in ``ignore``): 0.30.0rc2 builds its
    registered MX MoE schemes (``w8a8_mxfp8.py:278``, ``w4a4_mxfp4.py:212``) whose stacked
    ``w13_*`` / ``w2_*`` parameters take every expert's tensors; 0.26.0rc1 refuses the layers."""
    export = make_export(case)
    modules = engine_modules(export.model_dir, "vllm")
    resolutions = ascend_engine.resolve_compressed_tensors_export(export.path, case.arch, modules)
    experts = [r for r in resolutions if r.module.kind == "experts"]
    attention = [r for r in resolutions if r.module.leaf in ("qkv_proj", "o_proj")]
    assert len(experts) == 2 and len(attention) == 4
    value = case.weight["dtype"]
    if vllm_ascend.version == "0.26.0rc1":
        assert all(r.error for r in attention), [r.method for r in attention]
        if value == "mxfp8":
            assert all(r.error for r in experts), [r.method for r in experts]
            return
        # mxfp4 experts: read as weight-only W4A8_MXFP, built with the packed names, so they
        # load; but that scheme quantizes activations to MXFP8, not MXFP4 (msquant warns)
        method = "AscendFusedMoEMethod[AscendW4A8MXFPDynamicFusedMoEMethod]"
        assert {r.method for r in experts} == {method}
        problems = loading_problems(experts, read_tensor_table(export.path))
        assert problems == []
        assert export.warned("0.26.0rc1", "MXFP4 MoE experts", "MXFP8 activations")
        return
    scheme, suffix, dtype, per_byte = MOE_SCHEMES[value]
    assert [r.error for r in resolutions if r.error] == []
    assert loading_problems(resolutions, read_tensor_table(export.path)) == []
    assert {r.method for r in experts} == {f"AscendFusedMoEMethod[{scheme}]"}
    for resolution in experts:
        assert params_of(resolution) == mx_moe_params(resolution.module, suffix, dtype, per_byte)
    routers = [r for r in resolutions if r.module.leaf == "gate"]
    assert routers and not any(r.quantized for r in routers)
