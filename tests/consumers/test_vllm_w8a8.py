"""vLLM 0.33.0's own int8 W8A8 code against msquant's compressed-tensors W8A8 exports (issue 16).

For every module vLLM builds, the real ``CompressedTensorsConfig`` picks the method and the real
``CompressedTensorsW8A8Int8.create_weights`` makes the parameters; every exported tensor must fill
one of them (names, dtypes, shapes). Then each quantized linear (fused q/k/v and gate/up
included) is loaded from the export and vLLM's CUTLASS int8 kernel runs on the CPU: its real
``process_weights_after_loading`` (transposed weight, the fused layer's input scale, the
asymmetric zero point rebuilt from the ranges and folded into ``azp_adj``) and ``apply_weights``,
with the CUDA ops replaced by their reference computations (:mod:`vllm_int8_ops`). Its output is
compared with msquant's simulated forward of the same tensors. Opt-in (``pytest -m consumers``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
import vllm_engine
from act_cases import CT_W8A8
from architectures import EngineModule, engine_modules
from exports import Export, ExportCase, ExportFactory
from loading import int8_linears, loading_problems, read_tensor_table, read_tensors

from msquant.plugin import ActivationQuant

pytestmark = [pytest.mark.consumers, pytest.mark.usefixtures("vllm")]

SCHEME = "CompressedTensorsW8A8Int8"


@pytest.mark.parametrize("case", list(CT_W8A8.values()), ids=list(CT_W8A8))
def test_vllm_builds_its_w8a8_int8_scheme_and_every_tensor_loads(
    case: ExportCase, make_export: ExportFactory
) -> None:
    export = make_export(case)
    modules = engine_modules(export.model_dir, "vllm")
    resolutions = vllm_engine.resolve_export(export.path, case.arch, modules)
    assert loading_problems(resolutions, read_tensor_table(export.path)) == []
    static = case.act["scope"] == "per_tensor"  # type: ignore[attr-defined]
    asymmetric = not case.act["symmetric"]  # type: ignore[attr-defined]
    quantized = {m.prefix for m in int8_linears(export.model_dir, export.path, "vllm")}
    linear = [r for r in resolutions if r.module.prefix in quantized]
    assert len(linear) >= 4
    for resolution in resolutions:
        if resolution.module.kind == "linear" and resolution.module.prefix not in quantized:
            assert resolution.method == "UnquantizedLinearMethod"  # MoE routers
        if resolution.module.kind == "experts":
            assert resolution.method == "CompressedTensorsW8A8Int8MoEMethod"
            assert resolution.params["w13_weight"].dtype == torch.int8
    for resolution in linear:
        assert resolution.method == "CompressedTensorsLinearMethod", resolution.module.prefix
        params = resolution.params
        rows = resolution.module.output_size
        assert params["weight"].dtype == torch.int8
        assert params["weight"].shape == (rows, resolution.module.input_size)
        assert (params["weight_scale"].dtype, params["weight_scale"].shape) == (
            torch.float32,
            (rows, 1),
        )
        assert ("input_scale" in params) == static
        assert ("input_zero_point" in params) == (static and asymmetric)
        if "input_zero_point" in params:
            assert params["input_zero_point"].dtype == torch.int8
    head = next(r for r in resolutions if r.module.kind == "lm_head")
    assert not head.quantized


def _load(layer: torch.nn.Module, module: EngineModule, tensors: dict[str, torch.Tensor]) -> None:
    """What the fused layers' weight loaders do at tensor-parallel size 1: shards concatenated
    along the parameter's output dimension, per-tensor parameters loaded shard by shard (the
    last one stays; msquant's shards hold equal ones, checked)."""
    for name, param in layer.named_parameters(recurse=False):
        sources = [tensors[f"{shard}.{name}"] for shard in module.shards]
        dim = getattr(param, "output_dim", None)
        if dim is None:
            assert all(torch.equal(s, sources[0]) for s in sources), name
            param.data.copy_(sources[-1])
        else:
            param.data.copy_(torch.cat(sources, dim=dim))


def _simulated(
    module: EngineModule, tensors: dict[str, torch.Tensor], x: torch.Tensor
) -> torch.Tensor:
    """msquant's forward of the shards: input fake-quantized from the stored activation
    parameters (per token when none are stored), weight ``codes * weight_scale``."""
    outputs = []
    for shard in module.shards:
        scale = tensors.get(f"{shard}.input_scale")
        zero = tensors.get(f"{shard}.input_zero_point")
        if scale is None:
            act = ActivationQuant("per_token")
        else:
            offset = 0.0 if zero is None else float(zero[0])
            act = ActivationQuant("per_tensor", zero is None, float(scale[0]), offset)
        weight = tensors[f"{shard}.weight"].double() * tensors[f"{shard}.weight_scale"].double()
        bias = tensors.get(f"{shard}.bias")
        outputs.append(
            F.linear(act.fake_quantize(x.double()), weight, None if bias is None else bias.double())
        )
    return torch.cat(outputs, dim=-1)


def _kernel_forward(
    export: Export, module: EngineModule, config: Any, tensors: dict[str, torch.Tensor]
) -> tuple[float, tuple[int, int] | None]:
    """vLLM's output for ``module`` against msquant's simulation (relative max difference), and
    ``(stored, used)`` zero points when vLLM's weight processing changed the stored one."""
    layer = vllm_engine.LAYER_CLASSES[module.cls](module)
    method = config.get_quant_method(layer, prefix=module.prefix)
    vllm_engine.create_weights(method, layer, module)
    assert type(layer.scheme).__name__ == SCHEME
    _load(layer, module, tensors)
    stored = getattr(layer, "input_zero_point", None)
    stored_zero = None if stored is None else int(stored)
    method.process_weights_after_loading(layer)
    used = getattr(layer, "input_zero_point", None)
    shifted = None
    if stored_zero is not None and used is not None and int(used) != stored_zero:
        shifted = (stored_zero, int(used))
    x = torch.randn(3, 5, module.input_size) * 2.0
    bias = [tensors.get(f"{shard}.bias") for shard in module.shards]
    joined = None if bias[0] is None else torch.cat(bias)  # type: ignore[arg-type]
    got = method.apply(layer, x, joined).double()
    want = _simulated(module, tensors, x)
    return float((got - want).abs().max() / want.abs().max()), shifted


@pytest.mark.parametrize("case", list(CT_W8A8.values()), ids=list(CT_W8A8))
def test_vllm_int8_kernel_forward_matches_msquants_simulation(
    case: ExportCase, make_export: ExportFactory
) -> None:
    """Equal to 1e-5 on every layer, except where vLLM's CUTLASS weight processing rebuilds a
    static asymmetric zero point one step off: it recomputes it from the range as
    ``(-128 - range_min / scale).to(int32)``, which truncates ``-0.99999`` to 0 (a vLLM
    behaviour for any checkpoint; msquant warns about static asymmetric activations)."""
    export = make_export(case)
    config = vllm_engine.quant_config_for(export.path, case.arch)
    tensors = read_tensors(export.path)
    torch.manual_seed(0)
    results = {
        module.prefix: _kernel_forward(export, module, config, tensors)
        for module in int8_linears(export.model_dir, export.path, "vllm")
    }
    assert len(results) >= 4
    shifted = {prefix: zero for prefix, (_, zero) in results.items() if zero is not None}
    for prefix, (error, zero) in results.items():
        if zero is None:
            assert error < 1e-5, (prefix, error)
        else:
            stored, used = zero
            assert abs(used) == abs(stored) - 1 and used * stored >= 0, (prefix, zero)
            assert error > 1e-4, (prefix, error)  # one activation step off, visibly
    if case.act["symmetric"]:  # type: ignore[attr-defined]
        assert shifted == {}
    assert export.warned("zero point", "vLLM") == (not case.act["symmetric"])  # type: ignore[attr-defined]
