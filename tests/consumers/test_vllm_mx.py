"""vLLM 0.33.0 / 0.34.0's own compressed-tensors code against msquant's MX exports (issue 26).

The real ``CompressedTensorsConfig`` (``_get_scheme_from_parts``: ``_is_mxfp4`` / ``_is_mxfp8``,
float group-32 symmetric weights, the latter with ``scale_dtype`` uint8) picks the real
``CompressedTensorsW8A8Mxfp8`` (W8A8_MXFP8 export) or ``CompressedTensorsW4A4Mxfp4`` (W4A4_MXFP4
export) for every quantized linear, fused q/k/v and gate/up included, and their own
``create_weights`` create the parameters every exported tensor must fill (name, shape, dtype).
Only the kernel choice is recorded instead of made (it needs the GPU's capability and
FlashInfer): the MXFP4 scheme must ask for MXFP4 dynamic activations (vLLM's ``kMxfp4Dynamic``),
not the FP8 ones of ``CompressedTensorsW4A8Mxfp4``. The experts of the Qwen3-MoE exports get the
real ``CompressedTensorsW8A8Mxfp8MoEMethod`` / ``CompressedTensorsW4A4Mxfp4MoEMethod`` (built by
``get_moe_method``), whose ``create_weights`` make the stacked ``w13_*`` / ``w2_*`` parameters
every expert's tensors must fill; their kernel oracles are answered as on an H100 (Marlin).
Opt-in (``pytest -m consumers``).
"""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import torch
import vllm_engine
from act_cases import ActExportCase
from architectures import engine_modules
from exports import ExportFactory
from loading import loading_problems, read_tensor_table

pytestmark = [pytest.mark.consumers, pytest.mark.usefixtures("vllm")]


def mx(dtype: str) -> dict[str, Any]:
    return {"dtype": dtype, "scope": "per_block", "symmetric": True, "method": "minmax"}


def params_of(resolution: Any) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """The parameters an engine's method created for a module: name -> (dtype, shape)."""
    return {key: (p.dtype, tuple(p.shape)) for key, p in resolution.params.items()}


def mx_linear_params(
    linear: Any, weight_name: str, dtype: torch.dtype, per_byte: int
) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """The parameters an MX linear method creates (vLLM's and vLLM-Ascend's alike): the
    elements ``weight_name`` of ``dtype`` with ``per_byte`` per stored column, and uint8 E8M0
    scales per block of 32."""
    rows, columns = linear.output_size, linear.input_size
    return {
        weight_name: (dtype, (rows, columns // per_byte)),
        "weight_scale": (torch.uint8, (rows, columns // 32)),
    }


def mx_moe_params(
    experts: Any, suffix: str, dtype: torch.dtype, per_byte: int
) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """The stacked parameters an MX MoE method creates for ``experts`` (vLLM's and
    vLLM-Ascend's alike): ``w13_weight<suffix>`` / ``w2_weight<suffix>`` of ``dtype`` with
    ``per_byte`` elements per stored column, and uint8 E8M0 scales per block of 32."""
    count, hidden, width = experts.num_experts, experts.input_size, experts.output_sizes[0]
    return {
        f"w13_weight{suffix}": (dtype, (count, 2 * width, hidden // per_byte)),
        f"w2_weight{suffix}": (dtype, (count, hidden, width // per_byte)),
        "w13_weight_scale": (torch.uint8, (count, 2 * width, hidden // 32)),
        "w2_weight_scale": (torch.uint8, (count, hidden, width // 32)),
    }


#: (case, the scheme vLLM must pick, the weight parameter, its dtype, input columns per byte)
CASES = [
    (
        ActExportCase("ct_w8a8_mxfp8", "llama", "compressed_tensors", mx("mxfp8"), act=mx("mxfp8")),
        "CompressedTensorsW8A8Mxfp8",
        "weight",
        torch.float8_e4m3fn,
        1,
    ),
    (
        ActExportCase("ct_w4a4_mxfp4", "llama", "compressed_tensors", mx("mxfp4"), act=mx("mxfp4")),
        "CompressedTensorsW4A4Mxfp4",
        "weight_packed",
        torch.uint8,
        2,
    ),
]


@pytest.mark.parametrize(
    ("case", "scheme_name", "weight_name", "weight_dtype", "per_byte"),
    CASES,
    ids=[case[0].name for case in CASES],
)
def test_vllm_picks_the_mx_scheme_for_every_linear_and_every_tensor_loads(
    case: ActExportCase,
    scheme_name: str,
    weight_name: str,
    weight_dtype: torch.dtype,
    per_byte: int,
    make_export: ExportFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    export = make_export(case)
    modules = engine_modules(export.model_dir, "vllm")
    vllm_engine.load_vllm()
    vllm_engine.MX_KERNELS.clear()
    made: list[str] = []
    from vllm.model_executor.layers.quantization.compressed_tensors import compressed_tensors

    real = getattr(compressed_tensors, scheme_name)

    class Recorded(real):  # type: ignore[misc, valid-type]
        """The real scheme; records that vLLM constructed it."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            made.append(scheme_name)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(compressed_tensors, scheme_name, Recorded)
    resolutions = vllm_engine.resolve_export(export.path, case.arch, modules)
    assert [r.error for r in resolutions if r.error] == []
    assert loading_problems(resolutions, read_tensor_table(export.path)) == []
    linear = [r for r in resolutions if r.module.kind == "linear"]
    assert len(linear) >= 4 and {r.method for r in linear} == {"CompressedTensorsLinearMethod"}
    assert len(made) == len(linear)  # fused q/k/v and gate/up: one scheme each
    for resolution in linear:
        expected = mx_linear_params(resolution.module, weight_name, weight_dtype, per_byte)
        assert params_of(resolution) == expected
    kinds = {kind for kind, _ in vllm_engine.MX_KERNELS}
    assert kinds == {"mxfp8" if per_byte == 1 else "mxfp4"}
    if per_byte == 2:  # W4A4: MXFP4 dynamic activations asked for, not FP8 (W4A8Mxfp4)
        from vllm.model_executor.layers.quantization.utils.quant_utils import kMxfp4Dynamic

        assert all(
            args["activation_quant_key"] == kMxfp4Dynamic for _, args in vllm_engine.MX_KERNELS
        )
    head = next(r for r in resolutions if r.module.kind == "lm_head")
    assert not head.quantized


MOE_MODULE = "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe"
#: value type -> (the module of vLLM's MX MoE method, its class, the experts' weight parameters'
#: suffix, their dtype, input columns per byte)
MOE_METHODS = {
    "mxfp8": (
        "compressed_tensors_moe_w8a8_mxfp8",
        "CompressedTensorsW8A8Mxfp8MoEMethod",
        "",
        torch.float8_e4m3fn,
        1,
    ),
    "mxfp4": (
        "compressed_tensors_moe_w4a4_mxfp4",
        "CompressedTensorsW4A4Mxfp4MoEMethod",
        "_packed",
        torch.uint8,
        2,
    ),
}
MOE_CASES = [
    ActExportCase(f"ct_{v}_moe_qwen3_moe", "qwen3_moe", "compressed_tensors", mx(v), act=mx(v))
    for v in MOE_METHODS
]


@pytest.mark.parametrize("case", MOE_CASES, ids=[case.name for case in MOE_CASES])
def test_vllm_picks_the_mx_moe_method_and_every_expert_tensor_loads(
    case: ActExportCase, make_export: ExportFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Qwen3-MoE, every linear MX (the router float, in ``ignore``): the real
    ``CompressedTensorsMoEMethod.get_moe_method`` (``_is_mxfp4`` / ``_is_mxfp8`` on the experts'
    gate/up/down group, ``compressed_tensors_moe.py:66-88`` of 0.34.0) builds the real MX MoE
    method, whose ``create_weights`` makes the stacked ``w13_*`` / ``w2_*`` parameters every
    expert's tensors must fill (name, shape, dtype); with the GPU answered as an H100 both
    methods run their experts on Marlin, weight-only."""
    export = make_export(case)
    modules = engine_modules(export.model_dir, "vllm")
    vllm_engine.load_vllm()
    vllm_engine.MX_MOE_BACKENDS.clear()
    value = case.weight["dtype"]
    module_name, method_name, suffix, dtype, per_byte = MOE_METHODS[value]
    methods: list[Any] = []
    module = importlib.import_module(f"{MOE_MODULE}.{module_name}")
    real = getattr(module, method_name)

    class Recorded(real):  # type: ignore[misc, valid-type]
        """The real method; keeps each instance vLLM builds."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            methods.append(self)

    Recorded.__name__ = method_name
    monkeypatch.setattr(module, method_name, Recorded)
    resolutions = vllm_engine.resolve_export(export.path, case.arch, modules)
    assert [r.error for r in resolutions if r.error] == []
    assert loading_problems(resolutions, read_tensor_table(export.path)) == []
    experts = [r for r in resolutions if r.module.kind == "experts"]
    attention = [r for r in resolutions if r.module.leaf in ("qkv_proj", "o_proj")]
    assert len(experts) == 2 and len(attention) == 4
    assert {r.method for r in experts} == {method_name} and len(methods) == len(experts)
    assert {r.method for r in attention} == {"CompressedTensorsLinearMethod"}
    for resolution in experts:
        assert params_of(resolution) == mx_moe_params(resolution.module, suffix, dtype, per_byte)
    if value == "mxfp8":  # the backend is chosen by the oracle (stubbed: Marlin on an H100)
        assert len(vllm_engine.MX_MOE_BACKENDS) == len(experts)
        assert all(m.weight_block_size == [1, 32] for m in methods)
    else:  # chosen by the method itself: no CUTLASS MXFP4 experts on SM 9.0, not XPU -> Marlin
        assert vllm_engine.MX_MOE_BACKENDS == []
        for method in methods:
            assert (method.use_cutlass_mxfp4, method.experts_cls, method.mxfp4_backend.name) == (
                False,
                vllm_engine.MarlinExperts,
                "MARLIN",
            )
            assert method.group_size == 32
    routers = [r for r in resolutions if r.module.leaf == "gate"]
    assert routers and not any(r.quantized for r in routers)
