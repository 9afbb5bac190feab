"""SGLang 0.5.23's own int8 W8A8 code against msquant's compressed-tensors W8A8 exports, and the
warnings msquant gives about it (``processors/sglang_limits.py``).

Three facts, each read in the wheel and then run here:

* static per-tensor activations load (``CompressedTensorsConfig._get_scheme_from_parts`` picks
  ``CompressedTensorsW8A8Int8(is_static_input_scheme=True)``, which creates ``input_scale`` and,
  asymmetric, ``input_zero_point``), but ``CompressedTensorsW8A8Int8.apply_weights``
  (``compressed_tensors/schemes/compressed_tensors_w8a8_int8.py``) always calls
  ``per_token_quant_int8(x)``: the stored scales are never used. Its real weight processing
  and ``apply_weights`` run on the CPU with the two kernels replaced by their reference
  computations (:mod:`sglang_int8_ops`);
* int8 W8A8 MoE experts are refused on a GPU: ``CompressedTensorsConfig.get_moe_scheme`` raises
  ``NotImplementedError("The W8A8Int8 Fused MoE scheme is implemented only for NPU for now.")``
  for per-token activations (static ones match no MoE scheme at all; msquant refuses them);
* DeepSeek's ``q_a_proj`` + ``kv_a_proj_with_mqa`` in int8 W8A8 with per-token activations load
  into SGLang's ``fused_qkv_a_proj_with_mqa``: the DeepSeek weight loader
  (``models/deepseek_common/deepseek_weight_loader.py``) concatenates ``weight [out, in]`` and
  ``weight_scale [out, 1]`` along dimension 0, which fits; with static activations the two
  ``input_scale [1]`` become ``[2]`` against the parameter's ``[1]``
  (``ReplicatedLinear.weight_loader`` asserts equal sizes). Opt-in (``pytest -m consumers``).
"""

from __future__ import annotations

import pytest
import sglang_engine
import sglang_int8_ops
import torch
import torch.nn.functional as F
from act_cases import CT_W8A8, CT_W8A8_SGLANG
from architectures import EngineModule, engine_modules
from exports import Export, ExportFactory
from loading import Resolution, int8_linears, loading_problems, read_tensor_table, read_tensors

from msquant.plugin import ActivationQuant

pytestmark = pytest.mark.consumers

SCHEME = "CompressedTensorsW8A8Int8"
DENSE = ["ct_w8a8_static_sym", "ct_w8a8_static_asym", "ct_w8a8_dynamic"]
MOE = [name for name in CT_W8A8 if "_moe_" in name]
DEEPSEEK_A_PROJ = "fused_qkv_a_proj_with_mqa"
STATIC_WARNING = "SGLang 0.5.23 loads these static int8 W8A8 layers but does not use"
MOE_WARNING = "SGLang 0.5.23 cannot load int8 W8A8 MoE experts on a GPU"


def _resolve(export: Export) -> tuple[list[Resolution], list[str]]:
    modules = engine_modules(export.model_dir, "sglang")
    resolutions = sglang_engine.resolve_export(export.path, export.case.arch, modules)
    return resolutions, loading_problems(resolutions, read_tensor_table(export.path))


def _load(layer: torch.nn.Module, module: EngineModule, tensors: dict[str, torch.Tensor]) -> None:
    """What SGLang's fused layers' loaders do at tensor-parallel size 1: shards concatenated along
    the parameter's output dimension; per-tensor parameters (msquant's shards hold equal ones,
    checked) loaded from the last shard."""
    for name, param in layer.named_parameters(recurse=False):
        sources = [tensors[f"{shard}.{name}"] for shard in module.shards]
        dim = getattr(param, "output_dim", None)
        if dim is None:
            assert all(torch.equal(s, sources[0]) for s in sources), name
            param.data.copy_(sources[-1].reshape(param.shape))
        else:
            param.data.copy_(torch.cat(sources, dim=dim))


def _msquant_forward(
    module: EngineModule, tensors: dict[str, torch.Tensor], x: torch.Tensor, per_token: bool
) -> torch.Tensor:
    """msquant's float64 forward of the shards: input fake-quantized per token, or from the
    stored static parameters, weight ``codes * weight_scale``."""
    outputs = []
    for shard in module.shards:
        scale = tensors.get(f"{shard}.input_scale")
        zero = tensors.get(f"{shard}.input_zero_point")
        if per_token or scale is None:
            act = ActivationQuant("per_token")
        else:
            offset = 0.0 if zero is None else float(zero[0])
            act = ActivationQuant("per_tensor", zero is None, float(scale[0]), offset)
        weight = tensors[f"{shard}.weight"].double() * tensors[f"{shard}.weight_scale"].double()
        outputs.append(F.linear(act.fake_quantize(x.double()), weight))
    return torch.cat(outputs, dim=-1)


def _sglang_forward(
    config: object, module: EngineModule, tensors: dict[str, torch.Tensor], x: torch.Tensor
) -> torch.Tensor:
    """SGLang's layer for ``module`` loaded from the export, its real weight processing, then its
    real ``apply`` on ``x`` (float32: the reference ops compute in float32 anyway)."""
    layer, method = sglang_engine.build(config, module)
    assert type(layer.scheme).__name__ == SCHEME
    _load(layer, module, tensors)
    method.process_weights_after_loading(layer)
    calls = len(sglang_int8_ops.PER_TOKEN_CALLS)
    out = method.apply(layer, x, None)
    assert len(sglang_int8_ops.PER_TOKEN_CALLS) == calls + 1  # it quantized x per token
    return out.double()


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


@pytest.mark.parametrize("name", DENSE)
def test_sglang_loads_w8a8_and_quantizes_activations_per_token_whatever_is_stored(
    name: str, make_export: ExportFactory
) -> None:
    """Every tensor fills SGLang's parameters (``input_scale`` / ``input_zero_point`` included
    when static); SGLang's output equals msquant's per-token forward to 1e-5 for every layer,
    static or not, and is unchanged when the stored input scales are replaced by others: they
    are not used. For static exports it visibly differs from the static forward msquant
    evaluated, and msquant says so; for the per-token export it says nothing."""
    case = CT_W8A8[name]
    export = make_export(case)
    resolutions, problems = _resolve(export)
    assert problems == []
    static = case.act["scope"] == "per_tensor"  # type: ignore[attr-defined]
    config = sglang_engine.quant_config_for(export.path, case.arch)
    tensors = read_tensors(export.path)
    modules = int8_linears(export.model_dir, export.path, "sglang")
    assert len(modules) >= 4
    torch.manual_seed(0)
    x = torch.randn(7, max(m.input_size for m in modules)) * 2.0
    static_gaps = []
    for module in modules:
        resolution = next(r for r in resolutions if r.module.prefix == module.prefix)
        assert ("input_scale" in resolution.params) == static
        x_in = x[:, : module.input_size]
        got = _sglang_forward(config, module, tensors, x_in)
        assert _relative(got, _msquant_forward(module, tensors, x_in, per_token=True)) < 1e-5
        if static:
            other = {k: (v * 1000 if k.endswith("input_scale") else v) for k, v in tensors.items()}
            assert torch.equal(_sglang_forward(config, module, other, x_in), got)
            static_gaps.append(
                _relative(got, _msquant_forward(module, tensors, x_in, per_token=False))
            )
    if static:
        assert max(static_gaps) > 1e-3, static_gaps
    assert export.warned(STATIC_WARNING) == static
    assert export.warned("SGLang", "concatenates") is False


@pytest.mark.parametrize("name", MOE)
def test_sglang_refuses_w8a8_moe_experts_on_a_gpu_and_msquant_warns(
    name: str, make_export: ExportFactory
) -> None:
    """Every experts module is refused by SGLang's own ``get_moe_scheme`` (CUDA platform), the
    other layers load; msquant's warning names the experts modules."""
    export = make_export(CT_W8A8[name])
    resolutions, problems = _resolve(export)
    experts = [r for r in resolutions if r.module.kind == "experts"]
    assert experts
    refused = [r for r in experts if r.error]
    assert refused and all("implemented only for NPU" in (r.error or "") for r in refused)
    assert {r.module.prefix for r in refused} == {
        r.module.prefix for r in experts if r.module.quantizable
    }
    assert all(p.split(":")[0] in {r.module.prefix for r in refused} for p in problems), problems
    (warning,) = [w for w in export.warnings if MOE_WARNING in w]
    listed = warning.split("cannot load this checkpoint (")[1].split(";")[0].split(", ")
    # msquant names modules as transformers does (Mixtral's block_sparse_moe is mlp there)
    layers = {p.split(".experts")[0].rpartition(".")[0] for p in listed}
    assert layers == {r.module.prefix.split(".experts")[0].rpartition(".")[0] for r in refused}


def test_sglang_loads_deepseek_w8a8_per_token_a_projections_and_msquant_does_not_warn(
    make_export: ExportFactory,
) -> None:
    """The joined a-projection resolves to SGLang's W8A8 int8 scheme and the export's two
    ``weight`` / ``weight_scale`` tensors, concatenated along dimension 0, are its parameters'
    shapes; msquant no longer warns that SGLang cannot load them."""
    export = make_export(CT_W8A8["ct_w8a8_dynamic_moe_deepseek_v3"])
    resolutions, problems = _resolve(export)
    fused = [r for r in resolutions if r.module.prefix.endswith(DEEPSEEK_A_PROJ)]
    assert len(fused) == 2
    for resolution in fused:
        assert resolution.error is None and resolution.method == "CompressedTensorsLinearMethod"
        assert set(resolution.params) == {"weight", "weight_scale"}
    assert not [p for p in problems if DEEPSEEK_A_PROJ in p], problems
    assert not export.warned("kv_a_proj_with_mqa", "concatenates")


def test_sglang_cannot_join_deepseek_static_w8a8_a_projections_and_msquant_warns(
    make_export: ExportFactory,
) -> None:
    """Static activations add one ``input_scale [1]`` per a-projection: joined, ``[2]`` against
    the parameter's ``[1]``."""
    export = make_export(CT_W8A8_SGLANG["ct_w8a8_static_deepseek_v3"])
    _, problems = _resolve(export)
    joined = [p for p in problems if DEEPSEEK_A_PROJ in p]
    assert joined and all("input_scale" in p for p in joined), problems
    assert export.warned("concatenates", "kv_a_proj_with_mqa", "input_scale")


@pytest.mark.parametrize("name", ["ct_w8a8_dynamic_moe_qwen3_moe", "ct_w8a8_dynamic_moe_mixtral"])
def test_transformers_cannot_load_w8a8_moe_experts_and_msquant_warns(
    name: str, make_export: ExportFactory
) -> None:
    """The installed transformers fuses the experts while loading and its compressed-tensors
    conversion finds nothing to fuse (``RuntimeError``); the dense int8 W8A8 export loads."""
    import transformers

    export = make_export(CT_W8A8[name])
    with pytest.raises(RuntimeError, match="automatic conversion of the weights"):
        transformers.AutoModelForCausalLM.from_pretrained(export.path)
    assert export.warned("int8 W8A8 MoE experts", f"transformers {transformers.__version__}")
    dense = make_export(CT_W8A8["ct_w8a8_dynamic"])
    transformers.AutoModelForCausalLM.from_pretrained(dense.path)
    assert not dense.warned("int8 W8A8 MoE experts")
