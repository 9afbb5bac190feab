"""SGLang 0.5.23's quantization code, run on the CPU against a checkpoint folder.

Real (from the wheel, unchanged): the quantization registry (``layers/quantization/__init__.py``:
which names exist on a CUDA machine, ``get_quantization_config``), ``base_config.py``,
``utils.py`` (``get_linear_quant_method``, ``get_dynamic_override``, ``override_config``: the
``dynamic`` rules), the GPTQ configs and methods (``gptq/gptq.py``: ``GPTQMarlinConfig`` with
``override_quantization_method`` / ``is_gptq_marlin_compatible``, ``GPTQConfig``) and schemes
(``gptq/schemes/gptq_marlin.py``, ``gptq_moe.py``: the parameters they create), the Marlin support
checks (``marlin_utils.py``) and the Marlin linear kernel's weight preparation
(``hardware_backend/gpu/quantization/gptq_kernels.py``), the compressed-tensors config, target
matching and WNA16 schemes (``compressed_tensors/compressed_tensors.py``, ``utils.py``,
``schemes/compressed_tensors_wNa16.py``, ``compressed_tensors_wNa16_moe.py``) and the int8 W8A8
linear scheme (``schemes/compressed_tensors_w8a8_int8.py``: its weight processing and
``apply_weights``, their two kernels ``per_token_quant_int8`` / ``sgl_kernel.int8_scaled_mm``
being reference computations in :mod:`sglang_int8_ops`), ``parameter.py``,
``vocab_parallel_embedding.py`` (the real ``ParallelLMHead``: its vocabulary padding, the
quantization method it asks for and its weight loader), ``environ.py``.

Stubbed (see :data:`STUBS`): the linear layer classes and ``FusedMoE`` (the harness builds them;
the quantization code calls ``isinstance`` on them and registers parameters into them), the
unquantized methods' ``create_weights`` (float ``weight [out, in]``, experts
``w13_weight [E, 2I, H]`` / ``w2_weight [E, H, I]``, as ``unquant.py`` creates them), the configs
of other formats in the registry (placeholders deriving from the real ``QuantizationConfig``,
so their ``override_quantization_method`` answers None: the real ones claim only their own
formats or an explicit ``--quantization``, which the harness never passes), the other
compressed-tensors and GPTQ schemes (placeholders that fail if SGLang picks them), CUDA kernels
(``gptq_marlin_repack`` records its call and returns an empty tensor of the repacked shape),
``sgl_kernel.scalar_type`` (the sglang-kernel wheel is a CUDA build: vLLM 0.33's
``scalar_type.py``, which it copies, stands in), MoE runner state (the default ``auto``
backend), tensor-parallel state (rank 0 of 1), the platform (an SM 9.0 CUDA GPU; SGLang calls
``torch.cuda.get_device_capability`` directly, answered (9, 0) while SGLang's code runs).

What SGLang's ``ModelConfig._verify_quantization`` does around the registry (ask every
registered config's ``override_quantization_method``, first answer wins, else keep
``quant_method``) is three lines repeated by :func:`detect_method`; the rest of ``ModelConfig``
needs the server arguments.
"""

from __future__ import annotations

import contextlib
import enum
import json
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sglang_int8_ops
import torch
import vllm_engine
from architectures import EngineModule, sglang_packed_modules
from engine_layers import (
    FusedMoeWeightScaleSupported,
    fill_linear_classes,
    linear_classes,
    noop,
    parameter,
    set_weight_attrs,
    weight_loader,
)
from loading import Resolution, param_infos
from wheels import (
    CudaPlatformStub,
    EngineImporter,
    Release,
    WheelSource,
    install,
    placeholder_class,
    stub,
)

SGLANG = Release("sglang", "0.5.23")
#: Parameter dtype of the served model (SGLang serves GPTQ / compressed-tensors in half precision).
PARAMS_DTYPE = torch.bfloat16
#: What SGLang asks of a CUDA device (an H100/H200).
DEVICE_CAPABILITY = (9, 0)

QUANT = "sglang.srt.layers.quantization"
CT = f"{QUANT}.compressed_tensors"

REAL = (
    "sglang.srt.environ",
    "sglang.srt.layers.modelopt_utils",
    "sglang.srt.layers.parameter",
    "sglang.srt.layers.vocab_parallel_embedding",
    QUANT,
    f"{QUANT}.base_config",
    f"{QUANT}.base_scheme",
    f"{QUANT}.utils",
    f"{QUANT}.marlin_utils",
    f"{QUANT}.gptq",
    f"{QUANT}.gptq.gptq",
    f"{QUANT}.gptq.schemes.gptq_scheme",
    f"{QUANT}.gptq.schemes.gptq_marlin",
    f"{QUANT}.gptq.schemes.gptq_moe",
    f"{CT}.compressed_tensors",
    f"{CT}.utils",
    f"{CT}.schemes.compressed_tensors_scheme",
    f"{CT}.schemes.compressed_tensors_wNa16",
    f"{CT}.schemes.compressed_tensors_wNa16_moe",
    f"{CT}.schemes.compressed_tensors_w8a8_int8",
    "sglang.srt.hardware_backend.gpu.quantization.gptq_kernels",
)


# -- stand-ins for the layer classes --------------------------------------------------------------


# SGLang's ``LinearBase`` also holds ``scheme``: set by compressed-tensors' ``get_quant_method``,
# read by the GPTQ methods.
_LINEAR = linear_classes("SGLang", PARAMS_DTYPE, scheme=None)
(LinearBase, ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear,
 RowParallelLinear, ReplicatedLinear) = _LINEAR  # fmt: skip


class FusedMoE(torch.nn.Module):
    """SGLang's ``FusedMoE`` (``fused_moe_triton/layer.py``): the experts of one MoE block, with
    the attributes the quantization schemes read (tensor-parallel size 1, gated SiLU)."""

    scheme: Any = None

    def __init__(self, module: EngineModule) -> None:
        super().__init__()
        self.layer_name = module.prefix
        self.num_experts = module.num_experts
        self.num_local_experts = module.num_experts
        self.hidden_size = module.input_size
        self.intermediate_size_per_partition = module.output_sizes[0]
        self.moe_tp_size = 1
        self.moe_ep_size = 1
        self.params_dtype = PARAMS_DTYPE
        self.moe_runner_config = types.SimpleNamespace(
            is_gated=True, activation="silu", apply_router_weight_on_input=False
        )


#: The harness's module classes (named as in :mod:`architectures`) -> SGLang's layer class.
LAYER_CLASSES: dict[str, type[torch.nn.Module]] = {
    "ColumnParallelLinear": ColumnParallelLinear,
    "MergedColumnParallelLinear": MergedColumnParallelLinear,
    "QKVParallelLinear": QKVParallelLinear,
    "RowParallelLinear": RowParallelLinear,
    "ReplicatedLinear": ReplicatedLinear,
    "GateLinear": ReplicatedLinear,  # SGLang builds every router as a ReplicatedLinear
    "RoutedExperts": FusedMoE,
}


def _unquantized_methods() -> types.SimpleNamespace:
    """``unquant.py``'s three methods (their ``create_weights``), created once ``base_config`` is
    importable (they subclass it)."""
    from sglang.srt.layers.quantization.base_config import (
        FusedMoEMethodBase,
        LinearMethodBase,
        QuantizeMethodBase,
    )

    def linear_weights(
        self: Any, layer: torch.nn.Module, input_size_per_partition: int,
        output_partition_sizes: list[int], input_size: int, output_size: int,
        params_dtype: torch.dtype, **extra: Any,
    ) -> None:  # fmt: skip
        data = torch.empty(
            sum(output_partition_sizes), input_size_per_partition, dtype=params_dtype
        )
        weight = parameter(data, input_dim=1, output_dim=0)
        layer.register_parameter("weight", weight)
        set_weight_attrs(weight, extra)

    def refuse(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("kernels are not run by the consumer harness")

    class UnquantizedEmbeddingMethod(QuantizeMethodBase):
        create_weights = linear_weights
        apply = refuse
        embedding = refuse

    class UnquantizedLinearMethod(LinearMethodBase):
        create_weights = linear_weights
        apply = refuse

    class UnquantizedFusedMoEMethod(FusedMoEMethodBase):
        def __init__(self, *flags: Any) -> None:
            self.flags = flags

        def create_weights(
            self, layer: torch.nn.Module, num_experts: int, hidden_size: int,
            intermediate_size_per_partition: int, params_dtype: torch.dtype, **extra: Any,
        ) -> None:  # fmt: skip
            width = intermediate_size_per_partition
            for name, shape in (
                ("w13_weight", (num_experts, 2 * width, hidden_size)),
                ("w2_weight", (num_experts, hidden_size, width)),
            ):
                layer.register_parameter(name, parameter(torch.empty(*shape, dtype=params_dtype)))

        apply = refuse
        create_moe_runner = refuse

    return types.SimpleNamespace(
        embedding=UnquantizedEmbeddingMethod,
        linear=UnquantizedLinearMethod,
        moe=UnquantizedFusedMoEMethod,
    )


_UNQUANTIZED: types.SimpleNamespace | None = None


def unquantized() -> types.SimpleNamespace:
    global _UNQUANTIZED
    if _UNQUANTIZED is None:
        _UNQUANTIZED = _unquantized_methods()
    return _UNQUANTIZED


def _fill_unquant(module: types.ModuleType) -> None:
    methods = unquantized()
    module.UnquantizedEmbeddingMethod = methods.embedding
    module.UnquantizedLinearMethod = methods.linear
    module.UnquantizedFusedMoEMethod = methods.moe


def _fill_linear(module: types.ModuleType) -> None:
    fill_linear_classes(module, _LINEAR)
    module.set_weight_attrs = set_weight_attrs
    module._resolve_linear_group = lambda *args, **kwargs: None


# -- platform, parallel state, MoE runner ---------------------------------------------------------


def _fill_utils(module: types.ModuleType) -> None:
    """``sglang.srt.utils``: platform queries answered as on one SM 9.0 CUDA GPU."""
    answers = {
        "is_cuda": True, "is_cuda_alike": True, "is_hip": False, "is_npu": False,
        "is_cpu": False, "is_xpu": False, "is_mps": False, "is_gfx95_supported": False,
        "cpu_has_amx_support": False,
    }  # fmt: skip
    for name, value in answers.items():
        setattr(module, name, lambda *args, _value=value, **kwargs: _value)
    module.get_device_capability = lambda *args, **kwargs: DEVICE_CAPABILITY
    module.get_bool_env_var = lambda name, default="false": default.lower() in ("1", "true")
    module.set_weight_attrs = set_weight_attrs
    module.get_compiler_backend = lambda *args, **kwargs: None


def _identity_decorator(*args: Any, **kwargs: Any) -> Any:
    """A decorator factory whose decorators return the function unchanged."""
    return lambda function: function


@dataclass
class ParallelState:
    """``runtime_context.get_parallel()``: tensor / expert / attention parallel size 1."""

    tp_rank: int = 0
    tp_size: int = 1
    attn_tp_rank: int = 0
    attn_tp_size: int = 1
    moe_tp_rank: int = 0
    moe_tp_size: int = 1
    moe_ep_rank: int = 0
    moe_ep_size: int = 1


@dataclass
class PlatformFlags:
    """``runtime_context.get_platform()`` on an SM 9.0 GPU."""

    is_sm100: bool = False
    is_sm90: bool = True
    flags: dict[str, bool] = field(default_factory=dict)


def _fill_runtime_context(module: types.ModuleType) -> None:
    parallel, platform = ParallelState(), PlatformFlags()
    module.get_parallel = lambda: parallel
    module.get_platform = lambda: platform


class MoeRunnerBackend(enum.Enum):
    """``layers/moe/utils.py``: the backend names; the harness runs with the default ``auto``."""

    AUTO = "auto"
    TRITON = "triton"
    TRITON_KERNELS = "triton_kernel"
    MARLIN = "marlin"
    FLASHINFER_TRTLLM = "flashinfer_trtllm"

    def is_auto(self) -> bool:
        return self is MoeRunnerBackend.AUTO

    def __getattr__(self, name: str) -> Any:
        if name.startswith("is_"):  # is_triton(), is_flashinfer_trtllm(), ... : not auto
            return lambda: False
        raise AttributeError(name)


def _get_moe_runner_backend() -> MoeRunnerBackend:
    return MoeRunnerBackend.AUTO


def _fill_moe(module: types.ModuleType) -> None:
    module.MoeRunnerBackend = MoeRunnerBackend
    module.get_moe_runner_backend = _get_moe_runner_backend
    module.MoeRunnerConfig = types.SimpleNamespace
    module.MoeRunner = placeholder_class("MoeRunner")


def _fill_fused_moe(module: types.ModuleType) -> None:
    module.FusedMoE = FusedMoE
    module.FusedMoeWeightScaleSupported = FusedMoeWeightScaleSupported


# -- kernels ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RepackCall:
    """One call of SGLang's ``gptq_marlin_repack`` CUDA op (what Marlin is handed)."""

    size_k: int
    size_n: int
    num_bits: int


#: Calls of the stubbed ``gptq_marlin_repack``, in order.
REPACK_CALLS: list[RepackCall] = []


def _gptq_marlin_repack(
    b_q_weight: torch.Tensor, perm: torch.Tensor, size_k: int, size_n: int, num_bits: int
) -> torch.Tensor:
    """Records the call; returns an empty tensor of the op's output shape (its fake
    implementation in ``gptq/gptq.py``)."""
    REPACK_CALLS.append(RepackCall(size_k, size_n, num_bits))
    return b_q_weight.new_empty((size_k // 16, size_n * (num_bits // 2)))


def _scalar_types(module: types.ModuleType) -> None:
    """``sgl_kernel.scalar_type`` (from the CUDA-only sglang-kernel wheel): vLLM 0.33's
    ``scalar_type.py``, the file SGLang's kernel package copies."""
    vllm_engine.load_vllm()
    from vllm import scalar_type

    module.ScalarType = scalar_type.ScalarType
    module.scalar_types = scalar_type.scalar_types


def _placeholders(*names: str, base: str | None = None) -> Any:
    """A stub holding placeholder classes (config classes derive from the real
    ``QuantizationConfig`` so the registry can ask them ``override_quantization_method``)."""

    def fill(module: types.ModuleType) -> None:
        parent: type = object
        if base == "config":
            from sglang.srt.layers.quantization.base_config import QuantizationConfig

            parent = QuantizationConfig
        for name in names:
            setattr(module, name, placeholder_class(name, parent))

    return fill


def _ct_schemes(module: types.ModuleType) -> None:
    """``compressed_tensors/schemes/__init__`` imports every scheme (and their kernels): WNA16
    and the scheme bases are real, the others placeholders that fail if SGLang picks them."""
    from sglang.srt.layers.quantization.compressed_tensors.schemes import (
        compressed_tensors_scheme,
    )

    module.CompressedTensorsLinearScheme = compressed_tensors_scheme.CompressedTensorsLinearScheme
    module.CompressedTensorsMoEScheme = compressed_tensors_scheme.CompressedTensorsMoEScheme
    from sglang.srt.layers.quantization.compressed_tensors.schemes import (
        compressed_tensors_wNa16,
    )

    module.CompressedTensorsWNA16 = compressed_tensors_wNa16.CompressedTensorsWNA16
    module.XPUCompressedTensorsWNA16 = compressed_tensors_wNa16.XPUCompressedTensorsWNA16
    module.WNA16_SUPPORTED_BITS = compressed_tensors_wNa16.WNA16_SUPPORTED_BITS
    from sglang.srt.layers.quantization.compressed_tensors.schemes import (  # needs the above
        compressed_tensors_wNa16_moe,
    )

    module.CompressedTensorsWNA16MoE = compressed_tensors_wNa16_moe.CompressedTensorsWNA16MoE
    module.CompressedTensorsWNA16TritonMoE = (
        compressed_tensors_wNa16_moe.CompressedTensorsWNA16TritonMoE
    )
    module.NPUCompressedTensorsW4A16Int4DynamicMoE = (
        compressed_tensors_wNa16_moe.NPUCompressedTensorsW4A16Int4DynamicMoE
    )
    from sglang.srt.layers.quantization.compressed_tensors.schemes import (  # int8 W8A8
        compressed_tensors_w8a8_int8,
    )

    module.CompressedTensorsW8A8Int8 = compressed_tensors_w8a8_int8.CompressedTensorsW8A8Int8
    module.NPUCompressedTensorsW8A8Int8 = compressed_tensors_w8a8_int8.NPUCompressedTensorsW8A8Int8
    for name in (
        "CompressedTensorsMxInt4MoE", "CompressedTensorsW4A16Fp4",
        "CompressedTensorsW4A16Nvfp4MoE", "CompressedTensorsW4A4Fp4",
        "CompressedTensorsW4A4Nvfp4MoE", "CompressedTensorsW4AFP8MoE",
        "CompressedTensorsW8A16Fp8", "CompressedTensorsW8A8Fp8", "CompressedTensorsW8A8Fp8MoE",
        "NPUCompressedTensorsW4A8Int8DynamicMoE", "NPUCompressedTensorsW4A8mxfp4MoE",
        "NPUCompressedTensorsW8A8Int8DynamicMoE",
    ):  # fmt: skip
        setattr(module, name, placeholder_class(name))


def _gptq_schemes(module: types.ModuleType) -> None:
    """``gptq/schemes/__init__`` imports the CPU (AMX), Ascend and XPU schemes too: the CUDA ones
    (Marlin linear and MoE) are real, the others placeholders."""
    from sglang.srt.layers.quantization.gptq.schemes import gptq_marlin, gptq_moe, gptq_scheme

    module.GPTQLinearSchemeBase = gptq_scheme.GPTQLinearSchemeBase
    module.GPTQMoESchemeBase = gptq_scheme.GPTQMoESchemeBase
    module.GPTQMarlinLinearScheme = gptq_marlin.GPTQMarlinLinearScheme
    module.GPTQMarlinMoEScheme = gptq_moe.GPTQMarlinMoEScheme
    module.GPTQMoEAscendScheme = gptq_moe.GPTQMoEAscendScheme
    for name in (
        "GPTQLinearScheme", "GPTQAscendLinearScheme", "GPTQXPULinearScheme",
        "GPTQIntelAMXLinearScheme", "GPTQIntelAMXMoEScheme",
    ):  # fmt: skip
        setattr(module, name, placeholder_class(name))


#: The other formats' configs the registry imports (module -> class names).
OTHER_CONFIGS = {
    "auto_round": ("AutoRoundConfig",),
    "awq": ("AWQConfig", "AWQCPUConfig", "AWQMarlinConfig", "AWQXPUConfig"),
    "bitsandbytes": ("BitsAndBytesConfig",),
    "blockwise_int8": ("BlockInt8Config",),
    "fp8": ("Fp8Config", "Fp8LinearMethod"),
    "gguf": ("GGUFConfig",),
    "humming": ("HummingConfig",),
    "minimax_m3_nvfp4": ("MiniMaxM3Nvfp4Config",),
    "mlx": ("MlxQuantizationConfig",),
    "modelopt_quant": ("ModelOptFp4Config", "ModelOptFp8Config", "ModelOptMixedPrecisionConfig"),
    "modelslim.modelslim": ("ModelSlimConfig",),
    "moe_wna16": ("MoeWNA16Config",),
    "mxfp4": ("Mxfp4Config", "Mxfp4MoEMethod"),
    "npu_mxfp4": ("Mxfp4W4A8Config",),
    "npu_mxfp4_w4a4": ("Mxfp4W4A4Config",),
    "nvfp4_online": ("NvFp4OnlineConfig",),
    "petit": ("PetitNvFp4Config",),
    "quark.quark": ("QuarkConfig",),
    "quark_int4fp8_moe": ("QuarkInt4Fp8Config",),
    "w4afp8": ("W4AFp8Config",),
    "w8a8_fp8": ("W8A8Fp8Config",),
    "w8a8_int8": ("W8A8Int8Config",),
}


STUBS: dict[str, Any] = {
    "sgl_kernel": stub(int8_scaled_mm=sglang_int8_ops.int8_scaled_mm),
    "sgl_kernel.scalar_type": _scalar_types,
    "sglang.srt.utils": _fill_utils,
    "sglang.srt.utils.patch_torch": stub(register_fake_if_exists=_identity_decorator),
    "sglang.srt.utils.custom_op": stub(register_custom_op=_identity_decorator),
    "sglang.srt.utils.async_probe": stub(maybe_detect_oob=noop),
    "sglang.srt.platforms": stub(current_platform=CudaPlatformStub()),
    "sglang.srt.runtime_context": _fill_runtime_context,
    "sglang.srt.distributed": stub(
        divide=lambda numerator, denominator: numerator // denominator,
        tensor_model_parallel_all_reduce=noop,
    ),
    "sglang.srt.distributed.device_communicators.pynccl_allocator": stub(
        use_symmetric_memory=lambda *args, **kwargs: contextlib.nullcontext()
    ),
    "sglang.srt.layers.dp_attention": stub(
        attn_tp_all_reduce=noop,
        is_allocation_symmetric=lambda: False,
        is_dp_attention_enabled=lambda: False,
    ),
    "sglang.srt.layers.layer_boundary": stub(get_attn_tp_context=noop),
    "sglang.srt.layers.amx_utils": stub(PackWeightMethod=placeholder_class("PackWeightMethod")),
    "sglang.srt.layers.utils": stub(pad_or_narrow_weight=noop),
    "sglang.srt.layers.linear": _fill_linear,
    "sglang.srt.layers.radix_attention": stub(RadixAttention=placeholder_class("RadixAttention")),
    "sglang.srt.layers.moe": _fill_moe,
    "sglang.srt.layers.moe.utils": _fill_moe,
    "sglang.srt.layers.moe.moe_runner": _fill_moe,
    "sglang.srt.layers.moe.moe_runner.marlin": stub(
        MarlinMoeQuantInfo=placeholder_class("MarlinMoeQuantInfo")
    ),
    "sglang.srt.layers.moe.fused_moe_triton": _fill_fused_moe,
    "sglang.srt.layers.quantization.unquant": _fill_unquant,
    "sglang.srt.layers.quantization.kv_cache": stub(
        BaseKVCacheMethod=placeholder_class("BaseKVCacheMethod")
    ),
    "sglang.srt.layers.quantization.fp4_utils": stub(get_fp4_gemm_runner_backend=noop),
    f"{QUANT}.gptq.schemes": _gptq_schemes,
    f"{CT}.schemes": _ct_schemes,
    "sglang.srt.hardware_backend.npu.quantization.moe_methods": stub(
        NPUWNA16Int4MoEMethod=placeholder_class("NPUWNA16Int4MoEMethod")
    ),
    "sglang.srt.hardware_backend.npu.quantization.gptq_kernels": stub(
        GPTQMoEAscendKernel=placeholder_class("GPTQMoEAscendKernel")
    ),
    "sglang.srt.model_executor.runner_backend_utils.tc_piecewise_cuda_graph": stub(
        get_tc_piecewise_forward_context=noop
    ),
    "sglang.kernels.ops.quantization.fp8_kernel": stub(scaled_fp8_quant=noop),
    "sglang.kernels.ops.quantization.int8_kernel": stub(
        per_token_quant_int8=sglang_int8_ops.per_token_quant_int8
    ),
    "sglang.srt.hardware_backend.npu.quantization.linear_method_npu": stub(
        NPUW8A8Int8DynamicLinearMethod=placeholder_class("NPUW8A8Int8DynamicLinearMethod")
    ),
    "sglang.kernels.ops.quantization.gptq_marlin_repack": stub(
        gptq_marlin_repack=_gptq_marlin_repack
    ),
    "sglang.kernels.ops.gemm.gptq_marlin": stub(gptq_marlin_gemm=noop),
    "sglang.kernels.ops.embeddings.vocab_parallel_embedding": stub(vocab_parallel_embedding=noop),
    **{
        f"{QUANT}.{module}": _placeholders(*names, base="config")
        for module, names in OTHER_CONFIGS.items()
    },
}


_SOURCE: WheelSource | None = None


def load_sglang() -> WheelSource:
    """Download (once) and install SGLang's wheel behind the harness importer."""
    global _SOURCE
    if _SOURCE is None:
        _SOURCE = WheelSource(SGLANG)
        install(EngineImporter({"sglang": _SOURCE}, REAL, STUBS))
        import logging

        logging.getLogger("sglang").setLevel(logging.WARNING)
    return _SOURCE


#: ``torch.cuda.get_device_properties`` of an H100 SXM (Marlin sizes its workspace by the SMs).
DEVICE_PROPERTIES = types.SimpleNamespace(multi_processor_count=132, major=9, minor=0)


@contextlib.contextmanager
def cuda_device() -> Iterator[None]:
    """While SGLang's code runs, the ``torch.cuda`` queries it makes directly answer as an SM 9.0
    GPU: ``get_device_capability`` (compressed-tensors' scheme check) and
    ``get_device_properties`` (Marlin's workspace)."""
    saved = torch.cuda.get_device_capability, torch.cuda.get_device_properties
    torch.cuda.get_device_capability = lambda *args, **kwargs: DEVICE_CAPABILITY  # type: ignore[assignment]
    torch.cuda.get_device_properties = lambda *args, **kwargs: DEVICE_PROPERTIES  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.cuda.get_device_capability, torch.cuda.get_device_properties = saved  # type: ignore[assignment]


# -- from a checkpoint to SGLang's decisions -------------------------------------------------------


def hf_quantization_config(export: Path) -> dict[str, Any]:
    """The ``quantization_config`` of the export's ``config.json``."""
    return dict(json.loads((export / "config.json").read_text())["quantization_config"])


def detect_method(hf_config: dict[str, Any]) -> str:
    """The quantization SGLang serves the checkpoint with, no ``--quantization`` given:
    ``ModelConfig._verify_quantization`` asks every registered config class's
    ``override_quantization_method`` (first answer wins) and otherwise keeps ``quant_method``."""
    load_sglang()
    from sglang.srt.layers.quantization import QUANTIZATION_METHODS

    for method in QUANTIZATION_METHODS.values():
        override = method.override_quantization_method(hf_config, None)
        if override:
            return str(override)
    return str(hf_config.get("quant_method", "")).lower()


def quant_config_for(export: Path, arch: str) -> Any:
    """SGLang's quantization config object for an export folder, built as its model loader does
    (``get_quant_config``): the registry's class for the detected method (``ValueError`` when
    the name is not registered on CUDA), ``from_config`` of ``quantization_config`` with the
    model class's ``packed_modules_mapping``."""
    load_sglang()
    from sglang.srt.layers.quantization import get_quantization_config

    hf_config = hf_quantization_config(export)
    with cuda_device():
        cls = get_quantization_config(detect_method(hf_config))
        hf_config["packed_modules_mapping"] = {
            k: list(v) for k, v in sglang_packed_modules(arch).items()
        }
        return cls.from_config(hf_config)


#: Parameters SGLang's loaders may leave unread: the MoE schemes' sort indices are filled after
#: loading (``process_weights_after_loading``), and compressed-tensors' MoE ``weight_g_idx`` is
#: read only for ``actorder: group`` (which msquant never writes).
NOT_LOADED = frozenset(
    {"w13_g_idx_sort_indices", "w2_g_idx_sort_indices", "w13_weight_g_idx", "w2_weight_g_idx"}
)
#: MoE schemes whose checkpoint tensors SGLang's ``FusedMoE.weight_loader_impl`` transposes
#: (``loaded_weight.t()``, zero points excepted): compressed-tensors stores them ``[out, in]``.
TRANSPOSING_SCHEMES = (
    "CompressedTensorsWNA16MarlinMoE", "CompressedTensorsWNA16MoE", "CompressedTensorsWNA16TritonMoE",
)  # fmt: skip
#: Float parameters SGLang fills from integer checkpoint tensors by ``copy_`` (a cast): the
#: Marlin MoE scheme creates ``w13_qzeros`` / ``w2_qzeros`` in the params dtype; its kernel never
#: reads them for symmetric weights.
CAST_FROM_INT = frozenset({"w13_qzeros", "w2_qzeros"})


def lm_head(config: Any | None, module: EngineModule) -> torch.nn.Module:
    """SGLang's real ``ParallelLMHead`` for ``module``, built as the model class builds it
    (``quant_config`` passed unless the model class passes none): its constructor pads the
    vocabulary, asks the config for a method and lets it create the parameters."""
    load_sglang()
    from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead

    with cuda_device():
        return ParallelLMHead(
            module.output_size,
            module.input_size,
            params_dtype=PARAMS_DTYPE,
            quant_config=config if module.quantizable else None,
            prefix=module.prefix,
        )


def build(config: Any, module: EngineModule) -> tuple[torch.nn.Module, Any]:
    """SGLang's layer for ``module`` and its quantization method: the config is asked for a
    method and the method creates the parameters, as the layer's constructor does."""
    with cuda_device():
        if module.kind == "lm_head":
            head = lm_head(config, module)
            return head, head.quant_method
        layer = LAYER_CLASSES[module.cls](module)
        method = (
            config.get_quant_method(layer, prefix=module.prefix) if module.quantizable else None
        )
        if method is None:
            method = default_method(module)
        create_weights(method, layer, module)
        return layer, method


def resolve(config: Any, module: EngineModule) -> Resolution:
    """Ask SGLang's quantization config about ``module`` (:func:`build`) and describe what it
    decided: the method and the parameters it created, or the exception it raised."""
    try:
        layer, method = build(config, module)
    except (
        ValueError, NotImplementedError, RuntimeError, KeyError, AssertionError, ImportError,
        TypeError,
    ) as error:  # fmt: skip
        return Resolution(module, None, error=f"{type(error).__name__}: {error}")
    params = param_infos(layer)
    transposed = (
        frozenset(name for name in params if "zero" not in name)
        if type(getattr(layer, "scheme", None)).__name__ in TRANSPOSING_SCHEMES
        else frozenset()
    )
    return Resolution(
        module, type(method).__name__, params, None, NOT_LOADED, frozenset(), CAST_FROM_INT,
        transposed,
    )  # fmt: skip


def create_weights(method: Any, layer: torch.nn.Module, module: EngineModule) -> None:
    """Call ``method.create_weights`` with the arguments SGLang's ``LinearBase`` / ``FusedMoE``
    constructors pass at tensor-parallel size 1."""
    if module.kind == "experts":
        width = module.output_sizes[0]
        method.create_weights(
            layer=layer, num_experts=module.num_experts, hidden_size=module.input_size,
            intermediate_size_per_partition=width, params_dtype=PARAMS_DTYPE,
            weight_loader=weight_loader, with_bias=False, moe_intermediate_size=width,
        )  # fmt: skip
    else:
        # ReplicatedLinear (routers, DeepSeek's fused a-projection) passes one partition
        sizes = [module.output_size] if isinstance(layer, ReplicatedLinear) else module.output_sizes
        method.create_weights(
            layer, module.input_size, list(sizes), module.input_size, module.output_size,
            PARAMS_DTYPE, weight_loader=weight_loader,
        )  # fmt: skip


def default_method(module: EngineModule) -> Any:
    """The layer's own method when the config gives none (or the model passes no config)."""
    methods = unquantized()
    return methods.moe() if module.kind == "experts" else methods.linear()


def resolve_export(export: Path, arch: str, modules: list[EngineModule]) -> list[Resolution]:
    """SGLang's decision for every module of an export (a config SGLang rejects raises)."""
    config = quant_config_for(export, arch)
    return [resolve(config, module) for module in modules]
