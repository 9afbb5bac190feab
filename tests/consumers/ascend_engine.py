"""vLLM-Ascend's ``--quantization ascend`` code (msModelSlim exports), run on the CPU.

Real (from the vLLM-Ascend wheel): ``quantization/modelslim_config.py`` (``AscendModelSlimConfig``:
the description lookup, fused-shard checks, skip detection, the packed-module mapping per model
type, ``get_quant_method``), ``quantization/method_adapters.py`` (``AscendLinearMethod`` /
``AscendFusedMoEMethod.create_weights``: which parameters a scheme gets), the scheme registry and
every scheme in ``quantization/methods/`` (``@register_scheme``: which quant types exist for linear
and MoE layers, and each scheme's parameter shapes), ``quant_type.py``. vLLM-Ascend runs vLLM's
model code, so the modules are vLLM's (:mod:`vllm_engine` supplies vLLM's real and stubbed
modules).

Stubbed: ``torch_npu`` and every NPU op module (``vllm_ascend.ops``, ``device``, forward
contexts, distributed groups), ``vllm_ascend.utils`` (device type: A2; the NZ weight format is
a no-op), ``get_ascend_config`` (no dynamic EPLB) and the current vLLM config (the export's
``model_type``, the quant config being resolved).
"""

from __future__ import annotations

import enum
import json
import types
from pathlib import Path
from typing import Any

import torch
import vllm_engine
from architectures import PACKED_MODULES, EngineModule
from loading import Resolution, param_infos
from wheels import EngineImporter, Release, WheelSource, install, placeholder_class, stub

VLLM_ASCEND = Release("vllm-ascend", "0.26.0rc1")

REAL = (
    "vllm_ascend.quantization.quant_type",
    "vllm_ascend.quantization.utils",
    "vllm_ascend.quantization.modelslim_config",
    "vllm_ascend.quantization.method_adapters",
    "vllm_ascend.quantization.methods",
    "vllm_ascend.quantization.methods.*",
)


class AscendDeviceType(enum.Enum):
    """``vllm_ascend.utils.AscendDeviceType``: the harness answers as an Atlas A2."""

    A2 = 0
    A3 = 1
    _310P = 2
    A5 = 3


class AscendUnquantizedLinearMethod:
    """``vllm_ascend/ops/linear.py``: float ``weight [out, in]`` (vLLM's unquantized layout)."""

    def create_weights(
        self, layer: torch.nn.Module, input_size_per_partition: int,
        output_partition_sizes: list[int], input_size: int, output_size: int,
        params_dtype: torch.dtype, **extra: Any,
    ) -> None:  # fmt: skip
        data = torch.empty(
            sum(output_partition_sizes), input_size_per_partition, dtype=params_dtype
        )
        layer.register_parameter("weight", torch.nn.Parameter(data, requires_grad=False))


class AscendUnquantizedFusedMoEMethod(vllm_engine.UnquantizedFusedMoEMethod):
    """``vllm_ascend/ops/fused_moe/fused_moe.py``: vLLM's float experts layout."""


def _utils(module: types.ModuleType) -> None:
    module.ASCEND_QUANTIZATION_METHOD = "ascend"
    module.COMPRESSED_TENSORS_METHOD = "compressed-tensors"
    module.FP8_METHOD = "fp8"
    module.ACL_FORMAT_FRACTAL_NZ = 29
    module.AscendDeviceType = AscendDeviceType
    module.get_ascend_device_type = lambda: AscendDeviceType.A2
    module.calc_split_factor = lambda dims: dims
    module.maybe_trans_nz = lambda tensor, *args, **kwargs: tensor
    for flag in ("enable_dsa_cp", "mlp_tp_enable", "oproj_tp_enable"):
        setattr(module, flag, lambda *args, **kwargs: False)


def _weights_mapper(module: types.ModuleType) -> None:
    module.WeightsMapper = placeholder_class("WeightsMapper")


STUBS = {
    "torch_npu": stub(),
    "vllm.forward_context": stub(get_forward_context=lambda: None),
    "vllm.model_executor.layers.attention_layer_base": stub(
        AttentionLayerBase=placeholder_class("AttentionLayerBase")
    ),
    "vllm.model_executor.models.utils": _weights_mapper,
    "vllm_ascend.utils": _utils,
    "vllm_ascend.ascend_config": stub(
        get_ascend_config=lambda: types.SimpleNamespace(
            eplb_config=types.SimpleNamespace(dynamic_eplb=False)
        )
    ),
    "vllm_ascend.ascend_forward_context": stub(
        MoECommType=placeholder_class("MoECommType"),
        _EXTRA_CTX=None,
        use_cann_megamoe=lambda *a, **k: False,
    ),  # fmt: skip
    "vllm_ascend.device.mxfp_compat": stub(
        FLOAT8_E8M0FNU_DTYPE=None,
        **{
            name: lambda *a, **k: None
            for name in (
                "ensure_mxfp4_flatquant_linear_available",
                "ensure_mxfp4_linear_available",
                "ensure_mxfp4_moe_available",
                "ensure_mxfp8_linear_available",
                "ensure_mxfp8_moe_available",
            )  # fmt: skip
        },
    ),
    "vllm_ascend.distributed.parallel_state": stub(
        get_mc2_group=lambda: None, get_mlp_tp_group=lambda: None, get_otp_group=lambda: None
    ),
    "vllm_ascend.ops.linear": stub(AscendUnquantizedLinearMethod=AscendUnquantizedLinearMethod),
    "vllm_ascend.ops.fused_moe.fused_moe": stub(
        AscendUnquantizedFusedMoEMethod=AscendUnquantizedFusedMoEMethod
    ),
    "vllm_ascend.ops.fused_moe.experts_selector": stub(
        select_experts=lambda *a, **k: None, zero_experts_compute=lambda *a, **k: None
    ),
    "vllm_ascend.ops.fused_moe.moe_runtime_args": stub(
        build_fused_experts_input=lambda *a, **k: None
    ),
}

_SOURCE: WheelSource | None = None


def load_ascend() -> WheelSource:
    """Download (once) vLLM-Ascend's wheel and import it over vLLM's harness modules."""
    global _SOURCE
    if _SOURCE is None:
        vllm_source = vllm_engine.load_vllm()
        _SOURCE = WheelSource(VLLM_ASCEND)
        install(EngineImporter({"vllm_ascend": _SOURCE}, REAL, STUBS))
        assert vllm_source is not None
    return _SOURCE


def resolve_export(export: Path, model_type: str, modules: list[EngineModule]) -> list[Resolution]:
    """vLLM-Ascend's decision for every module of an msModelSlim-format export."""
    load_ascend()
    from vllm_ascend.quantization.modelslim_config import AscendModelSlimConfig

    description = json.loads((export / "quant_model_description.json").read_text())
    config = AscendModelSlimConfig()
    # what vLLM's loader does before building layers (configure_quant_config)
    config.packed_modules_mapping = {
        key: list(value) for key, value in PACKED_MODULES[model_type].items()
    }
    config.maybe_update_config(str(export))  # the real lookup of quant_model_description.json
    assert config.quant_description == description
    current = vllm_engine.CURRENT_CONFIG
    current.model_config = types.SimpleNamespace(
        hf_config=types.SimpleNamespace(model_type=model_type),
        hf_text_config=types.SimpleNamespace(model_type=model_type),
        enforce_eager=True,
        dtype=vllm_engine.PARAMS_DTYPE,
    )
    current.quant_config = config
    return [_resolve(config, module) for module in modules]


def _resolve(config: Any, module: EngineModule) -> Resolution:
    layer = vllm_engine.LAYER_CLASSES[module.cls](module)
    try:
        method = (
            config.get_quant_method(layer, prefix=module.prefix) if module.quantizable else None
        )
        if method is None:
            method = vllm_engine.default_method(module)
        vllm_engine.create_weights(method, layer, module)
    # ZeroDivisionError: the dense W4A8_DYNAMIC scheme divides by the description's group_size,
    # 0 for per-channel weights
    except (ValueError, NotImplementedError, KeyError, AssertionError, ZeroDivisionError) as error:
        return Resolution(module, None, error=f"{type(error).__name__}: {error}")
    scheme = getattr(method, "quant_method", None)
    name = type(method).__name__ + (f"[{type(scheme).__name__}]" if scheme is not None else "")
    return Resolution(module, name, param_infos(layer))
