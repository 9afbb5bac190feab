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
from engine_layers import noop
from loading import Resolution, param_infos
from wheels import (
    EngineImporter,
    Release,
    SdistSource,
    WheelSource,
    install,
    placeholder_class,
    stub,
    uninstall,
)

#: The vLLM-Ascend releases the suite checks: 0.26.0rc1 (a wheel; users still serve with it) and
#: 0.30.0rc2 (published as a source archive only).
RELEASES = (Release("vllm-ascend", "0.26.0rc1"), Release("vllm-ascend", "0.30.0rc2"))
VLLM_ASCEND = RELEASES[-1]
#: The vLLM release whose harness modules each runs over (0.30.0rc2 is built against vLLM 0.30.0,
#: which the harness does not carry: the vLLM code it calls is base classes and the stubs, which
#: 0.34.0 provides alike).
VLLM_OF = {"0.26.0rc1": vllm_engine.RELEASES[0], "0.30.0rc2": vllm_engine.RELEASES[-1]}
#: Releases published only as a source archive.
SDIST_ONLY = frozenset({"0.30.0rc2"})
#: Where ``AscendModelSlimConfig`` lives (0.30 moved the configs into ``quantization/configs/``
#: and the schemes into subpackages of ``methods/``).
CONFIG_MODULE = {
    "0.26.0rc1": "vllm_ascend.quantization.modelslim_config",
    "0.30.0rc2": "vllm_ascend.quantization.configs.modelslim_config",
}

COMMON_REAL = (
    "vllm_ascend.quantization.quant_type",
    "vllm_ascend.quantization.utils",
    "vllm_ascend.quantization.method_adapters",
    "vllm_ascend.quantization.methods",
    "vllm_ascend.quantization.methods.*",
)
#: Where ``AscendCompressedTensorsConfig`` (``--quantization compressed-tensors`` on Ascend) lives.
CT_CONFIG_MODULE = {
    "0.26.0rc1": "vllm_ascend.quantization.compressed_tensors_config",
    "0.30.0rc2": "vllm_ascend.quantization.configs.compressed_tensors_config",
}

REAL = {
    "0.26.0rc1": (
        *COMMON_REAL,
        "vllm_ascend.quantization.modelslim_config",
        CT_CONFIG_MODULE["0.26.0rc1"],
    ),
    "0.30.0rc2": (
        *COMMON_REAL,
        "vllm_ascend.quantization.configs.modelslim_config",
        CT_CONFIG_MODULE["0.30.0rc2"],
        "vllm_ascend.quantization.prepared_linear_input",
        # 0.30 asks a hardware profile (built from the device type) what the device supports
        "vllm_ascend.device.hardware",
        "vllm_ascend.device.hardware_profile",
        "vllm_ascend.device.device_config",
        # the schemes' base classes mix in its (pure Python) weight-switching primitives
        "vllm_ascend.weight_switch",
        "vllm_ascend.weight_switch.linear",
    ),
}


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
    # 0.30: the NZ format with its scale, tensor disposal, the MXFP KV-cache dtype name
    module.maybe_trans_nz_with_scale = lambda tensor, scale, *args, **kwargs: (tensor, scale)
    module.dispose_tensor = lambda tensor: None
    module.C8_MXFP_KV_CACHE_DTYPE = "mxfp8"
    for flag in (
        "enable_dsa_cp", "mlp_tp_enable", "oproj_tp_enable", "is_950", "model_uses_sfa_sparse",
        "enable_sfa",
    ):  # fmt: skip
        setattr(module, flag, lambda *args, **kwargs: False)


def _weights_mapper(module: types.ModuleType) -> None:
    module.WeightsMapper = placeholder_class("WeightsMapper")


class _NpuName:
    """An attribute of the ``torch_npu`` stand-in: a dtype or op name that 0.30's scheme classes
    read at class definition (``torch_npu.float4_e2m1fn_x2``); calling it means an NPU op was
    reached, which the harness never runs."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"torch_npu.{self.name}"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"the consumer harness does not run torch_npu.{self.name}")


def _torch_npu(module: types.ModuleType) -> None:
    def attribute(name: str) -> _NpuName:
        if name.startswith("__"):
            raise AttributeError(name)
        return _NpuName(name)

    module.__getattr__ = attribute  # type: ignore[method-assign]


STUBS = {
    "torch_npu": _torch_npu,
    # 0.30: what the build records; the device configuration reads the device type from it
    "vllm_ascend._build_info": stub(__device_type__="A2"),
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
    # 0.30: what the schemes import for their forward (MoE kernels, device ops), never called here
    "vllm_ascend.ops.fused_moe.routed_experts": stub(
        AscendUnquantizedFusedMoEMethod=AscendUnquantizedFusedMoEMethod,
        AscendRoutedExperts=placeholder_class("AscendRoutedExperts"),
    ),
    "vllm_ascend.ops.fused_moe.dataclass.fused_experts": stub(
        MoEWeights=placeholder_class("MoEWeights"), build_fused_experts_input=noop
    ),
    "vllm_ascend.ops.fused_moe.dataclass.moe_mlp": stub(
        MoEMlpComputeInput=placeholder_class("MoEMlpComputeInput")
    ),
    "vllm_ascend.ops.fused_moe.moe_utils": stub(
        cumsum_group_list=noop,
        maybe_normalize_mxfp_scale_layout=noop,
        _custom_gmm_swiglu_enabled=lambda *a, **k: False,
        _prepare_dequant_swiglu_weight_scale=noop,
    ),
    "vllm_ascend.device.device_op": stub(DeviceOperator=placeholder_class("DeviceOperator")),
    "vllm.model_executor.layers.fused_moe.activation": stub(
        MoEActivation=placeholder_class("MoEActivation")
    ),
    "vllm.triton_utils": stub(HAS_TRITON=False),
}

_ACTIVE: tuple[Release, WheelSource, EngineImporter] | None = None


def _unload() -> None:
    """Forget the imported vLLM-Ascend (before vLLM's release changes, or its own)."""
    global _ACTIVE
    if _ACTIVE is not None:
        uninstall(_ACTIVE[2])
        _ACTIVE = None


vllm_engine.BEFORE_SWITCH.append(_unload)


def use_ascend(release: Release) -> WheelSource:
    """Import ``release`` of vLLM-Ascend (downloaded once) over the vLLM release it runs on."""
    global _ACTIVE
    vllm_engine.use_vllm(VLLM_OF[release.version])
    if _ACTIVE is not None and _ACTIVE[0] == release:
        return _ACTIVE[1]
    _unload()
    source = SdistSource(release) if release.version in SDIST_ONLY else WheelSource(release)
    importer = EngineImporter({"vllm_ascend": source}, REAL[release.version], STUBS)
    install(importer)
    _ACTIVE = (release, source, importer)
    return source


def load_ascend() -> WheelSource:
    """The vLLM-Ascend imported now (the newest of :data:`RELEASES` if none was chosen)."""
    return use_ascend(_ACTIVE[0] if _ACTIVE is not None else VLLM_ASCEND)


def active_release() -> Release:
    load_ascend()
    assert _ACTIVE is not None
    return _ACTIVE[0]


def modelslim_config_class() -> Any:
    """``AscendModelSlimConfig`` of the imported release."""
    import importlib

    module = importlib.import_module(CONFIG_MODULE[active_release().version])
    return module.AscendModelSlimConfig


def resolve_export(export: Path, model_type: str, modules: list[EngineModule]) -> list[Resolution]:
    """vLLM-Ascend's decision for every module of an msModelSlim-format export."""
    description = json.loads((export / "quant_model_description.json").read_text())
    config = modelslim_config_class()()
    # what vLLM's loader does before building layers (configure_quant_config)
    config.packed_modules_mapping = {
        key: list(value) for key, value in PACKED_MODULES[model_type].items()
    }
    config.maybe_update_config(str(export))  # the real lookup of quant_model_description.json
    assert config.quant_description == description
    _set_current_config(config, model_type)
    return [_resolve(config, module) for module in modules]


def compressed_tensors_config_class() -> Any:
    """``AscendCompressedTensorsConfig`` of the imported release (what vLLM-Ascend registers for
    ``quant_method: compressed-tensors``, replacing vLLM's own)."""
    import importlib

    module = importlib.import_module(CT_CONFIG_MODULE[active_release().version])
    return module.AscendCompressedTensorsConfig


def resolve_compressed_tensors_export(
    export: Path, model_type: str, modules: list[EngineModule]
) -> list[Resolution]:
    """vLLM-Ascend's decision for every module of a compressed-tensors export: the real
    ``from_config`` on ``config.json``'s ``quantization_config``, the model's packed-module
    mapping (as vLLM's loader sets it), then ``get_quant_method`` and the scheme's
    ``create_weights`` per module."""
    hf_config = json.loads((export / "config.json").read_text())["quantization_config"]
    assert hf_config["quant_method"] == "compressed-tensors"
    config = compressed_tensors_config_class().from_config(hf_config)
    config.packed_modules_mapping = {
        key: list(value) for key, value in PACKED_MODULES[model_type].items()
    }
    _set_current_config(config, model_type)
    return [_resolve(config, module) for module in modules]


def _set_current_config(config: Any, model_type: str) -> None:
    """What ``get_current_vllm_config()`` answers while the layers are built."""
    current = vllm_engine.CURRENT_CONFIG
    current.model_config = types.SimpleNamespace(
        hf_config=types.SimpleNamespace(model_type=model_type),
        hf_text_config=types.SimpleNamespace(model_type=model_type),
        enforce_eager=True,
        dtype=vllm_engine.PARAMS_DTYPE,
    )
    current.quant_config = config


#: How vLLM-Ascend refuses a module while choosing and building its scheme. ZeroDivisionError:
#: the dense W4A8_DYNAMIC scheme divides by the description's group_size, 0 for per-channel
#: weights; TypeError: 0.26.0rc1's compressed-tensors config builds its W4A8_MXFP linear scheme
#: with an argument only the MoE scheme takes (``use_weight_packed``).
REFUSALS = (ValueError, NotImplementedError, KeyError, AssertionError, ZeroDivisionError, TypeError)


def _resolve(config: Any, module: EngineModule) -> Resolution:
    layer = vllm_engine.LAYER_CLASSES[module.cls](module)
    try:
        method = (
            config.get_quant_method(layer, prefix=module.prefix) if module.quantizable else None
        )
        if method is None:
            method = vllm_engine.default_method(module)
        vllm_engine.create_weights(method, layer, module)
    except REFUSALS as error:
        return Resolution(module, None, error=f"{type(error).__name__}: {error}")
    scheme = getattr(method, "quant_method", None)
    name = type(method).__name__ + (f"[{type(scheme).__name__}]" if scheme is not None else "")
    return Resolution(module, name, param_infos(layer))
