"""vLLM 0.33.0's quantization code, run on the CPU against a checkpoint folder.

Real (from the wheel, unchanged): the GPTQ config (``auto_gptq.py``: ``from_config``,
``maybe_update_config``, ``get_quant_method``, ``AutoGPTQLinearMethod`` / ``AutoGPTQMoEMethod``
``create_weights``), its rule matching (``utils/gptq_utils.py``), the Marlin support checks
(``utils/marlin_utils.py``), the compressed-tensors config, target matching and schemes
(``compressed_tensors/compressed_tensors.py``, ``utils.py``, ``schemes/compressed_tensors_wNa16.py``,
``compressed_tensors_moe/*.py``), the Marlin linear kernel's support check
(``kernels/linear/mixed_precision/marlin.py``, ``MPLinearKernel.py``), ``parameter.py``,
``scalar_type.py``, ``envs.py``; ``vocab_parallel_embedding.py`` is executed under a private name
by :mod:`vllm_head` (here it is a stub, see below).

Stubbed (see :data:`STUBS`): the layer classes (``LinearBase`` and its subclasses,
``ParallelLMHead``, ``RoutedExperts``: the harness builds them, the quantization code only calls
``isinstance`` on them and registers parameters into them), the unquantized methods'
``create_weights`` (float ``weight`` ``[out, in]`` / experts ``w13_weight [E, 2I, H]`` and
``w2_weight [E, H, I]``, as ``linear.py`` / ``unquantized_fused_moe_method.py`` create them),
kernel selection (``choose_mp_linear_kernel``, the MoE kernel oracle), custom ops, tensor-parallel
state (rank 0 of 1), the current platform (an SM 9.0 CUDA GPU), the logger and the vLLM config,
and what the real ``vocab_parallel_embedding.py`` imports besides (``PluggableLayer``, which only
names the class for out-of-tree replacement; the unquantized GEMM dispatch and ``is_fp8``, used
only in ``forward``).
"""

from __future__ import annotations

import enum
import json
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from architectures import PACKED_MODULES, EngineModule
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
    EngineLogger,
    Release,
    WheelSource,
    install,
    placeholder_class,
    stub,
    uninstall,
)

#: The vLLM releases the suite checks (users still serve with the older one); tests ask for one
#: through the ``vllm_release`` fixture, :func:`use_vllm` makes it the imported one.
RELEASES = (Release("vllm", "0.33.0"), Release("vllm", "0.34.0"))
VLLM = RELEASES[-1]
#: Parameter dtype of the served model (vLLM serves GPTQ / compressed-tensors in half precision).
PARAMS_DTYPE = torch.bfloat16
#: vLLM pads the vocabulary of ``ParallelLMHead`` to a multiple of this
#: (``vocab_parallel_embedding.py``: ``DEFAULT_VOCAB_PADDING_SIZE``).
VOCAB_PADDING = 64

REAL = (
    "vllm.envs",
    "vllm.scalar_type",
    "vllm.utils.math_utils",
    "vllm.utils.collection_utils",
    "vllm.model_executor.parameter",
    "vllm.model_executor.layers.quantization.base_config",
    "vllm.model_executor.layers.quantization.auto_gptq",
    "vllm.model_executor.layers.quantization.moe_wna16",
    "vllm.model_executor.layers.quantization.utils.gptq_utils",
    "vllm.model_executor.layers.quantization.utils.marlin_utils",
    "vllm.model_executor.layers.quantization.utils.quant_utils",
    "vllm.model_executor.layers.quantization.utils.config_utils",
    "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors",
    "vllm.model_executor.layers.quantization.compressed_tensors.utils",
    "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe",
    "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe.compressed_tensors_moe",
    "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe.compressed_tensors_moe_wna16",
    "vllm.model_executor.layers.quantization.compressed_tensors.schemes.compressed_tensors_scheme",
    "vllm.model_executor.layers.quantization.compressed_tensors.schemes.compressed_tensors_wNa16",
    # int8 W8A8 (issue 16): the scheme, and the CUTLASS int8 kernel's weight processing and
    # apply glue (its CUDA ops are the reference stand-ins of :mod:`vllm_int8_ops`)
    "vllm.model_executor.layers.quantization.compressed_tensors.schemes.compressed_tensors_w8a8_int8",
    "vllm.model_executor.kernels.linear.base",
    "vllm.model_executor.kernels.linear.scaled_mm.ScaledMMLinearKernel",
    "vllm.model_executor.kernels.linear.scaled_mm.cutlass",
    "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe.compressed_tensors_moe_w8a8_int8",
    # MX (issue 26): the schemes' create_weights, the MXFP8 constants they read; their kernel
    # choice (GPU capability, FlashInfer) is recorded by :data:`MX_KERNELS` instead
    "vllm.model_executor.layers.quantization.compressed_tensors.schemes.compressed_tensors_w4a4_mxfp4",
    "vllm.model_executor.layers.quantization.compressed_tensors.schemes.compressed_tensors_w4a8_mxfp4",
    "vllm.model_executor.layers.quantization.compressed_tensors.schemes.compressed_tensors_w8a8_mxfp8",
    "vllm.model_executor.layers.quantization.utils.mxfp8_utils",
    # MX MoE (issue 26): the experts' methods' constructors and create_weights; their kernel
    # choice and weight conversion are stubbed below (MX_MOE_BACKENDS records the MXFP8 one)
    "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe.compressed_tensors_moe_w8a8_mxfp8",
    "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe.compressed_tensors_moe_w4a4_mxfp4",
    # the Marlin linear kernel's own support check and tile padding (§1 #5 / #12)
    "vllm.model_executor.kernels.linear.mixed_precision.MPLinearKernel",
    "vllm.model_executor.kernels.linear.mixed_precision.marlin",
)


# -- stand-ins for the layer classes --------------------------------------------------------------


_LINEAR = linear_classes("vLLM", PARAMS_DTYPE)
(LinearBase, ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear,
 RowParallelLinear, ReplicatedLinear) = _LINEAR  # fmt: skip


class GateLinear(ReplicatedLinear):
    pass


class VocabParallelEmbedding(torch.nn.Module):
    pass


class ParallelLMHead(VocabParallelEmbedding):
    def __init__(self, module: EngineModule) -> None:
        super().__init__()
        self.prefix = module.prefix
        vocab = module.output_size
        self.num_embeddings = vocab
        self.num_embeddings_padded = -(-vocab // VOCAB_PADDING) * VOCAB_PADDING
        self.embedding_dim = module.input_size


class RoutedExperts(torch.nn.Module):
    """vLLM's ``RoutedExperts`` (what ``FusedMoE`` builds): the experts of one MoE block."""

    def __init__(self, module: EngineModule) -> None:
        super().__init__()
        self.prefix = module.prefix
        gate, up, down = module.expert_roles
        self.ckpt_gate_proj_name, self.ckpt_up_proj_name, self.ckpt_down_proj_name = gate, up, down
        width = module.output_sizes[0]
        self.moe_config = types.SimpleNamespace(
            num_experts=module.num_experts,
            num_local_experts=module.num_experts,
            hidden_dim=module.input_size,
            hidden_dim_unpadded=module.input_size,
            intermediate_size_per_partition=width,
            intermediate_size_per_partition_unpadded=width,
            w13_num_shards=2,
            is_act_and_mul=True,
            moe_backend="auto",  # no --moe-backend given (the MX MoE methods read it)
            in_dtype=PARAMS_DTYPE,
            has_bias=False,
            moe_parallel_config=types.SimpleNamespace(tp_size=1, ep_size=1, use_ep=False),
        )
        self._loaded_expert_biases: set[str] = set()

    def weight_loader(self, *args: Any, **kwargs: Any) -> None:
        """``FusedMoE.weight_loader`` (vLLM-Ascend 0.30 wraps it for msModelSlim's expert
        names while the quant method is chosen); loading is not run through it here."""
        raise NotImplementedError("the consumer harness does not load experts through vLLM")


LAYER_CLASSES: dict[str, type[torch.nn.Module]] = {
    cls.__name__: cls
    for cls in (
        ColumnParallelLinear,
        MergedColumnParallelLinear,
        QKVParallelLinear,
        RowParallelLinear,
        ReplicatedLinear,
        GateLinear,
        ParallelLMHead,
        RoutedExperts,
    )
}


class _MethodBase:
    """Base of the stubbed methods; real methods derive from vLLM's ``QuantizeMethodBase``."""


def _unquantized_linear_methods() -> tuple[type, type, type]:
    """The unquantized methods, created after base_config is importable (they subclass it)."""
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    class LinearMethodBase(QuantizeMethodBase):
        def apply(self, layer: torch.nn.Module, *args: Any, **kwargs: Any) -> torch.Tensor:
            raise NotImplementedError("kernels are not run by the consumer harness")

    class UnquantizedLinearMethod(LinearMethodBase):
        """``linear.py``: float ``weight [sum(output_partition_sizes), input_size]``."""

        def create_weights(
            self, layer: torch.nn.Module, input_size_per_partition: int,
            output_partition_sizes: list[int], input_size: int, output_size: int,
            params_dtype: torch.dtype, **extra: Any,
        ) -> None:  # fmt: skip
            data = torch.empty(
                sum(output_partition_sizes), input_size_per_partition, dtype=params_dtype
            )
            layer.register_parameter("weight", parameter(data, input_dim=1, output_dim=0))

    class UnquantizedEmbeddingMethod(UnquantizedLinearMethod):
        pass

    return LinearMethodBase, UnquantizedLinearMethod, UnquantizedEmbeddingMethod


class FusedMoEMethodBase:
    """``fused_moe_method_base.py``: keeps the MoE config."""

    def __init__(self, moe: Any) -> None:
        self.moe = moe
        self.moe_config = moe

    is_monolithic = False


class UnquantizedFusedMoEMethod(FusedMoEMethodBase):
    """``unquantized_fused_moe_method.py``: float ``w13_weight [E, 2I, H]``, ``w2_weight [E, H, I]``."""

    def create_weights(
        self, layer: torch.nn.Module, num_experts: int, hidden_size: int,
        intermediate_size_per_partition: int, params_dtype: torch.dtype, **extra: Any,
    ) -> None:  # fmt: skip
        width = intermediate_size_per_partition
        layer.register_parameter(
            "w13_weight",
            parameter(torch.empty(num_experts, 2 * width, hidden_size, dtype=params_dtype)),
        )
        layer.register_parameter(
            "w2_weight", parameter(torch.empty(num_experts, hidden_size, width, dtype=params_dtype))
        )


class WNA16MoEBackend(enum.Enum):
    """``fused_moe/oracle/int_wna16.py``'s backend names (the oracle itself needs the GPU)."""

    MARLIN = "MARLIN"
    BATCHED_MARLIN = "BATCHED_MARLIN"
    HUMMING = "HUMMING"
    CPU = "CPU"
    ZEN_CPU = "ZEN_CPU"
    FLASHINFER_TRTLLM = "FLASHINFER_TRTLLM"
    TRITON = "TRITON"
    XPU = "XPU"
    EMULATION = "EMULATION"
    RDNA3 = "RDNA3"


def _select_wna16_moe_backend(*args: Any, **kwargs: Any) -> tuple[WNA16MoEBackend, None]:
    """Kernel choice for WNA16 MoE (the oracle needs the GPU); Marlin is what an H100 gets."""
    return WNA16MoEBackend.MARLIN, None


@dataclass
class MPLinearLayerConfig:
    """``kernels/linear``: the description a mixed-precision linear kernel is chosen by."""

    full_weight_shape: tuple[int, int]
    partition_weight_shape: tuple[int, int]
    weight_type: Any
    act_type: torch.dtype
    group_size: int
    zero_points: bool
    has_g_idx: bool = False
    out_type: torch.dtype | None = None


class _Kernel:
    """A chosen kernel: records its configuration, runs nothing."""

    def __init__(self, config: MPLinearLayerConfig, **names: Any) -> None:
        self.config = config
        self.names = names


def _choose_mp_linear_kernel(config: MPLinearLayerConfig, *args: Any, **kwargs: Any) -> type:
    return _Kernel


def _init_int8_linear_kernel(
    is_channelwise: bool,
    is_static_input_scheme: bool,
    input_symmetric: bool,
    module_name: str,
    is_fused_module: bool = False,
) -> Any:
    """``kernels/linear/__init__.py``: the int8 W8A8 kernel a CUDA GPU gets first (CUTLASS, from
    the wheel), built with the parameter names the real function passes."""
    from vllm.model_executor.kernels.linear.scaled_mm.cutlass import (
        CutlassInt8ScaledMMLinearKernel,
    )
    from vllm.model_executor.kernels.linear.scaled_mm.ScaledMMLinearKernel import (
        Int8ScaledMMLinearLayerConfig,
    )

    config = Int8ScaledMMLinearLayerConfig(
        is_static_input_scheme=is_static_input_scheme,
        is_channelwise=is_channelwise,
        input_symmetric=input_symmetric,
        is_fused_module=is_fused_module,
    )
    names = ["weight", "weight_scale", "input_scale", "input_zero_point", "azp_adj"]
    return CutlassInt8ScaledMMLinearKernel(config, layer_param_names=names)


#: The MX linear kernels vLLM's schemes asked for (``init_mxfp4_linear_kernel`` /
#: ``init_mxfp8_linear_kernel`` need the GPU to choose): ``(kind, arguments)`` in call order.
MX_KERNELS: list[tuple[str, dict[str, Any]]] = []


def _init_mxfp4_linear_kernel(activation_quant_key: Any = None) -> _Kernel:
    """``kernels/linear/__init__.py`` ``init_mxfp4_linear_kernel``: recorded, nothing chosen."""
    MX_KERNELS.append(("mxfp4", {"activation_quant_key": activation_quant_key}))
    return _Kernel(None, activation_quant_key=activation_quant_key)  # type: ignore[arg-type]


def _init_mxfp8_linear_kernel(*, weight_shape: Any, bmm_batch_size: Any = None) -> _Kernel:
    """``kernels/linear/__init__.py`` ``init_mxfp8_linear_kernel``: recorded, nothing chosen."""
    MX_KERNELS.append(("mxfp8", {"weight_shape": tuple(weight_shape)}))
    return _Kernel(None, weight_shape=weight_shape)  # type: ignore[arg-type]


#: The MXFP8 MoE kernel choices vLLM's method asked for (``select_mxfp8_moe_backend`` needs the
#: GPU): the ``FusedMoEConfig`` of each call, in call order.
MX_MOE_BACKENDS: list[Any] = []


class MarlinExperts:
    """``fused_moe/experts/marlin_moe.py``'s ``MarlinExperts``: the weight-only MoE kernel an
    H100 gets for MX experts (``_supports_current_device``: CUDA SM 7.5+; its
    ``_supports_quant_scheme`` checks the weight key only, so MX activations are not quantized);
    only named here, never built."""


def _select_mxfp8_moe_backend(config: Any) -> tuple[str, type]:
    """``fused_moe/oracle/mxfp8.py`` ``select_mxfp8_moe_backend``: recorded, and answered with
    what its priority list gives on an H100 (FlashInfer TRT-LLM and DeepGEMM's MXFP8 path need
    SM100, ``experts/trtllm_fp8_moe.py:174-181``, ``experts/deep_gemm_moe.py:184-187``; Marlin
    is next)."""
    MX_MOE_BACKENDS.append(config)
    return "MARLIN", MarlinExperts


class CutlassExpertsMxfp4:
    """``fused_moe/experts/cutlass_moe.py``'s ``CutlassExpertsMxfp4``: vLLM's W4A4 MXFP4 experts
    kernel (MXFP4 weights and activations, a Blackwell CUTLASS grouped GEMM), which the MXFP4 MoE
    method takes when its C++ check ``ops.mxfp4_experts_quant_supported(capability)`` passes.
    The harness has no C++ ops: it answers False, the H100 answer it assumes (not run here; a
    build without the op answers False too, ``_custom_ops.py``), so the method takes Marlin."""

    @staticmethod
    def _supports_current_device() -> bool:
        return False


class Mxfp4MoeBackend(enum.Enum):
    """``fused_moe/oracle/mxfp4.py``'s backend names the MXFP4 MoE method refers to (the oracle
    itself needs the GPU and FlashInfer)."""

    NONE = "None"
    B12X_MXFP4_MXFP8 = "B12X_MXFP4_MXFP8"
    B12X_MXFP4_BF16 = "B12X_MXFP4_BF16"
    DEEPGEMM_MXFP4 = "DEEPGEMM_MXFP4"
    CUTLASS_MXFP4_MXFP4 = "CUTLASS_MXFP4_MXFP4"
    MARLIN = "MARLIN"
    XPU = "XPU"
    FLASHINFER_MOE_EP_CUTEDSL = "FLASHINFER_MOE_EP_CUTEDSL"
    FLASHINFER_MOE_EP_DEEP_GEMM = "FLASHINFER_MOE_EP_DEEP_GEMM"


def _select_mxfp4_moe_backend(config: Any) -> tuple[Mxfp4MoeBackend, type]:
    """``select_mxfp4_moe_backend``: the MXFP4 MoE method asks only for an explicit
    ``--moe-backend`` (b12x, deep_gemm, FlashInfer MoE-EP); the harness gives none."""
    raise NotImplementedError("the consumer harness selects no MXFP4 MoE backend by name")


def _is_flashinfer_moe_ep_backend(moe_backend: str) -> bool:
    """``fused_moe/flashinfer_moe_ep.py``: whether ``--moe-backend`` names one of FlashInfer's
    MoE-EP megakernels; ``auto`` (the harness's, :class:`RoutedExperts`) names none."""
    if moe_backend != "auto":
        raise NotImplementedError(
            f"the consumer harness knows moe_backend 'auto' only, not {moe_backend!r}"
        )
    return False


class PluggableLayer(torch.nn.Module):
    """``custom_op.PluggableLayer``: a module whose class out-of-tree plugins may replace (none
    here); ``register`` only names the class."""

    @classmethod
    def register(cls, name: str) -> Any:
        return lambda layer_class: layer_class


def _fill_linear(module: types.ModuleType) -> None:
    base, unquantized, _ = _unquantized_linear_methods()
    fill_linear_classes(module, _LINEAR)
    module.LinearMethodBase = base
    module.UnquantizedLinearMethod = unquantized
    from vllm.model_executor.utils import set_weight_attrs

    module.set_weight_attrs = set_weight_attrs


def _fill_vocab(module: types.ModuleType) -> None:
    *_, embedding = _unquantized_linear_methods()
    module.VocabParallelEmbedding = VocabParallelEmbedding
    module.ParallelLMHead = ParallelLMHead
    module.UnquantizedEmbeddingMethod = embedding


def _fill_model_executor_utils(module: types.ModuleType) -> None:
    """``model_executor/utils.py`` needs torch_utils; only its two helpers are used here."""

    def replace_parameter(layer: torch.nn.Module, name: str, new: torch.Tensor) -> None:
        layer.register_parameter(name, torch.nn.Parameter(new, requires_grad=False))

    module.set_weight_attrs = set_weight_attrs
    module.replace_parameter = replace_parameter
    # 0.34: weight processing helpers (after loading only; never reached by create_weights)
    module.is_weights_pre_processed = lambda *args, **kwargs: False
    module.retire_parameter = noop
    module.copy_weight_ = lambda dst, src: dst.copy_(src)  # a plain copy_ off integrated GPUs
    module.move_parameter = noop  # 0.34's MXFP4 scheme, after loading only


def _quantization_package(module: types.ModuleType) -> None:
    module.QuantizationMethods = str
    # the registered method names (vLLM-Ascend 0.26's compressed-tensors config removes vLLM's
    # own "compressed-tensors" entry from it before registering its replacement)
    module.QUANTIZATION_METHODS = ["ascend", "compressed-tensors", "fp8", "gptq"]

    def register_quantization_config(name: str) -> Any:
        return lambda cls: cls

    module.register_quantization_config = register_quantization_config


def _compressed_tensors_schemes(module: types.ModuleType) -> None:
    """``schemes/__init__`` imports every scheme (and their kernels); only WNA16 is loaded for
    real, the others are placeholders that fail if vLLM ever picks them for these exports."""
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import (
        compressed_tensors_scheme,
    )

    module.CompressedTensorsScheme = compressed_tensors_scheme.CompressedTensorsScheme
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import (
        compressed_tensors_wNa16,
    )

    module.CompressedTensorsWNA16 = compressed_tensors_wNa16.CompressedTensorsWNA16
    module.WNA16_SUPPORTED_BITS = compressed_tensors_wNa16.WNA16_SUPPORTED_BITS
    for name in (
        "CompressedTensorsW4A4Fp4", "CompressedTensorsW4A8Fp8",
        "CompressedTensorsW4A8Int", "CompressedTensorsW8A16Fp8",
        "CompressedTensorsW8A8Fp8",
        "CompressedTensorsWNA4Int", "CompressedTensorsWNA8Int", "CompressedTensorsWNA8O8Int",
    ):  # fmt: skip
        setattr(module, name, placeholder_class(name))
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import (
        compressed_tensors_w4a4_mxfp4,
        compressed_tensors_w4a8_mxfp4,
        compressed_tensors_w8a8_mxfp8,
    )

    module.CompressedTensorsW4A4Mxfp4 = compressed_tensors_w4a4_mxfp4.CompressedTensorsW4A4Mxfp4
    module.CompressedTensorsW4A8Mxfp4 = compressed_tensors_w4a8_mxfp4.CompressedTensorsW4A8Mxfp4
    module.CompressedTensorsW8A8Mxfp8 = compressed_tensors_w8a8_mxfp8.CompressedTensorsW8A8Mxfp8
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import (
        compressed_tensors_w8a8_int8,
    )

    module.CompressedTensorsW8A8Int8 = compressed_tensors_w8a8_int8.CompressedTensorsW8A8Int8


def _fill_fused_moe(module: types.ModuleType) -> None:
    module.RoutedExperts = RoutedExperts
    module.SharedExperts = placeholder_class("SharedExperts")
    module.FusedMoEMethodBase = FusedMoEMethodBase
    module.UnquantizedFusedMoEMethod = UnquantizedFusedMoEMethod
    module.FusedMoeWeightScaleSupported = FusedMoeWeightScaleSupported
    module.FusedMoEConfig = types.SimpleNamespace
    module.FusedMoEQuantConfig = placeholder_class("FusedMoEQuantConfig")
    module.MoERunner = placeholder_class("MoERunner")


class CompilationMode(enum.IntEnum):
    """``vllm.config.CompilationMode`` (vLLM-Ascend's W8A8_DYNAMIC MoE method compares with it)."""

    NONE = 0
    STOCK_TORCH_COMPILE = 1
    DYNAMO_TRACE_ONCE = 2
    VLLM_COMPILE = 3


#: What ``vllm.config.get_current_vllm_config()`` returns (vLLM-Ascend reads the model type and
#: the quantization config from it); ``get_current_vllm_config_or_none`` answers None (defaults).
CURRENT_CONFIG = types.SimpleNamespace(
    model_config=None,
    quant_config=None,
    kv_transfer_config=None,
    compilation_config=types.SimpleNamespace(mode=CompilationMode.NONE),
    parallel_config=types.SimpleNamespace(enable_expert_parallel=False, enable_eplb=False),
    # read by vLLM-Ascend 0.30's MoE schemes (EPLB off) and its KV-cache check (no C8 MXFP)
    use_v2_model_runner=False,
    cache_config=types.SimpleNamespace(cache_dtype="auto"),
)


def _fill_config(module: types.ModuleType) -> None:
    module.get_current_vllm_config = lambda: CURRENT_CONFIG
    module.get_current_vllm_config_or_none = lambda: None
    module.CompilationMode = CompilationMode


def _fill_platforms(module: types.ModuleType) -> None:
    module.current_platform = CudaPlatformStub()


def _tp_state(module: types.ModuleType) -> None:
    module.get_tensor_model_parallel_rank = lambda *a, **k: 0
    module.get_tensor_model_parallel_world_size = lambda *a, **k: 1
    module.GroupCoordinator = placeholder_class("GroupCoordinator")
    module.divide = lambda numerator, denominator: numerator // denominator
    module.tensor_model_parallel_all_reduce = noop
    group = types.SimpleNamespace(world_size=1, rank_in_group=0)
    module.get_tp_group = lambda *a, **k: group
    module.get_ep_group = lambda *a, **k: group


def _safetensors_metadata(module: types.ModuleType) -> None:
    """``transformers_utils/config.py`` is the HF-hub glue; ``get_safetensors_params_metadata``
    reads the ``dtype`` of every tensor from the local files' headers, which this does too."""

    def get_safetensors_params_metadata(model: str, revision: str | None = None) -> dict[str, Any]:
        metadata: dict[str, Any] = {}
        for path in sorted(Path(model).glob("*.safetensors")):
            with path.open("rb") as handle:
                size = int.from_bytes(handle.read(8), "little")
                header = json.loads(handle.read(size))
            header.pop("__metadata__", None)
            metadata.update(header)
        return metadata

    module.get_safetensors_params_metadata = get_safetensors_params_metadata


def _int8_ops(module: types.ModuleType) -> None:
    """``vllm._custom_ops``: the int8 ops the CUTLASS kernel calls, as the reference
    computations of :mod:`vllm_int8_ops` (the CUDA kernels cannot run here)."""
    import vllm_int8_ops

    module.scaled_int8_quant = vllm_int8_ops.scaled_int8_quant
    module.cutlass_scaled_mm = vllm_int8_ops.cutlass_scaled_mm
    module.cutlass_scaled_mm_azp = vllm_int8_ops.cutlass_scaled_mm_azp


def _quantization_utils(module: types.ModuleType) -> None:
    """``quantization/utils/__init__.py``: ``replace_parameter`` (what weight processing after
    loading calls)."""

    def replace_parameter(layer: torch.nn.Module, name: str, new: torch.Tensor) -> None:
        layer.register_parameter(name, torch.nn.Parameter(new.data, requires_grad=False))

    module.replace_parameter = replace_parameter


STUBS = {
    "vllm.logger": stub(init_logger=EngineLogger, logger=EngineLogger("vllm")),
    "vllm.platforms": _fill_platforms,
    "vllm.config": _fill_config,
    "vllm.distributed": _tp_state,
    "vllm.distributed.parallel_state": _tp_state,
    "vllm.distributed.utils": stub(verify_group_size_divides_partition=noop),
    "vllm._custom_ops": _int8_ops,
    "vllm.utils.platform_utils": stub(num_compute_units=lambda *a: 132),
    "vllm.utils.torch_utils": stub(direct_register_custom_op=noop, current_stream=noop),
    "vllm.transformers_utils.config": _safetensors_metadata,
    "vllm.model_executor.utils": _fill_model_executor_utils,
    "vllm.model_executor.layers.linear": _fill_linear,
    "vllm.model_executor.layers.vocab_parallel_embedding": _fill_vocab,
    "vllm.model_executor.layers.attention": stub(Attention=placeholder_class("Attention")),
    "vllm.model_executor.layers.fused_moe": _fill_fused_moe,
    "vllm.model_executor.layers.fused_moe.config": stub(
        FusedMoEConfig=types.SimpleNamespace,
        FusedMoEQuantConfig=placeholder_class("FusedMoEQuantConfig"),
        mxfp4_moe_quant_config=noop,  # the MXFP4 MoE kernel's config, after loading only
    ),
    "vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method": stub(
        UnquantizedFusedMoEMethod=UnquantizedFusedMoEMethod
    ),
    "vllm.model_executor.layers.fused_moe.oracle.int_wna16": stub(
        WNA16MoEBackend=WNA16MoEBackend,
        select_wna16_moe_backend=_select_wna16_moe_backend,
        convert_to_wna16_moe_kernel_format=noop,
        make_wna16_moe_kernel=noop,
        make_wna16_moe_quant_config=noop,
    ),
    # the int8 MoE kernel choice and conversion (need the GPU; not called by create_weights
    # except the backend choice)
    "vllm.model_executor.layers.fused_moe.oracle.int8": stub(
        convert_to_int8_moe_kernel_format=noop,
        make_int8_moe_kernel=noop,
        make_int8_moe_quant_config=noop,
        select_int8_moe_backend=lambda *a, **k: ("TRITON", None),
    ),
    # what the MX MoE methods import besides (kernel choice and weight conversion: the GPU's)
    "vllm.model_executor.layers.fused_moe.moe_output": stub(
        UnfinalizedMoEOutput=placeholder_class("UnfinalizedMoEOutput")
    ),
    "vllm.model_executor.layers.fused_moe.modular_kernel": stub(
        FusedMoEExperts=placeholder_class("FusedMoEExperts")  # a type hint only
    ),
    "vllm.model_executor.layers.fused_moe.oracle.fp8": stub(
        convert_to_fp8_moe_kernel_format=noop,
        make_fp8_moe_kernel=noop,
        make_fp8_moe_quant_config=noop,
    ),
    "vllm.model_executor.layers.fused_moe.oracle.mxfp8": stub(
        select_mxfp8_moe_backend=_select_mxfp8_moe_backend
    ),
    "vllm.model_executor.layers.fused_moe.oracle.mxfp4": stub(
        B12X_BACKENDS=(Mxfp4MoeBackend.B12X_MXFP4_MXFP8, Mxfp4MoeBackend.B12X_MXFP4_BF16),
        FLASHINFER_MOE_EP_MXFP4_BACKENDS=(
            Mxfp4MoeBackend.FLASHINFER_MOE_EP_CUTEDSL,
            Mxfp4MoeBackend.FLASHINFER_MOE_EP_DEEP_GEMM,
        ),
        Mxfp4MoeBackend=Mxfp4MoeBackend,
        convert_weight_to_mxfp4_moe_kernel_format=noop,
        make_mxfp4_moe_kernel=noop,
        make_mxfp4_moe_quant_config=noop,
        select_mxfp4_moe_backend=_select_mxfp4_moe_backend,
    ),
    "vllm.model_executor.layers.fused_moe.experts.cutlass_moe": stub(
        CutlassExpertsMxfp4=CutlassExpertsMxfp4
    ),
    "vllm.model_executor.layers.fused_moe.experts.marlin_moe": stub(MarlinExperts=MarlinExperts),
    "vllm.model_executor.layers.fused_moe.experts.xpu_moe": stub(
        XPUExpertsMxFp4=placeholder_class("XPUExpertsMxFp4")
    ),
    # the FlashInfer MoE-EP megakernels are chosen only by an explicit --moe-backend
    "vllm.model_executor.layers.fused_moe.flashinfer_moe_ep": stub(
        is_flashinfer_moe_ep_backend=_is_flashinfer_moe_ep_backend
    ),
    "vllm.model_executor.layers.quantization.utils.marlin_utils_fp4": stub(
        prepare_moe_fp4_layer_for_marlin=noop  # after loading only
    ),
    "vllm.model_executor.kernels.linear": stub(
        MPLinearLayerConfig=MPLinearLayerConfig,
        choose_mp_linear_kernel=_choose_mp_linear_kernel,
        MPLinearKernel=_Kernel,
        MarlinLinearKernel=placeholder_class("MarlinLinearKernel", _Kernel),
        init_int8_linear_kernel=_init_int8_linear_kernel,
        init_mxfp4_linear_kernel=_init_mxfp4_linear_kernel,
        init_mxfp8_linear_kernel=_init_mxfp8_linear_kernel,
    ),
    "vllm.model_executor.determinism.batch_invariant": stub(
        matmul_batch_invariant=noop,
        linear_batch_invariant=noop,
        gptq_linear_batch_invariant=noop,  # 0.34
    ),
    # what the real vocab_parallel_embedding.py imports (vllm_head.py executes it)
    "vllm.model_executor.custom_op": stub(PluggableLayer=PluggableLayer),
    "vllm.model_executor.layers.utils": stub(
        dispatch_unquantized_gemm=noop,
        maybe_use_skinny_gemm=noop,  # forward only; 0.34
    ),
    "vllm.model_executor.layers.quantization.utils.fp8_utils": stub(is_fp8=lambda *a: False),
    "vllm.model_executor.layers.quantization": _quantization_package,
    "vllm.model_executor.layers.quantization.utils": _quantization_utils,
    # what the CUTLASS int8 kernel's module imports besides (FP8 and block-FP8 paths only)
    "vllm.model_executor.layers.quantization.utils.w8a8_utils": stub(
        CUTLASS_BLOCK_FP8_SUPPORTED=False,
        convert_to_channelwise=noop,
        cutlass_fp8_supported=lambda *a, **k: False,
    ),
    "vllm.model_executor.layers.fusion.quant_activation": stub(
        QuantizedActivation=placeholder_class("QuantizedActivation"),
        as_quantized_activation=noop,
    ),
    "vllm.model_executor.kernels.linear.scaled_mm.BlockScaledMMLinearKernel": stub(
        Fp8BlockScaledMMLinearKernel=placeholder_class("Fp8BlockScaledMMLinearKernel")
    ),
    "vllm.model_executor.layers.quantization.utils.int8_utils": stub(per_token_quant_int8=noop),
    "vllm.model_executor.layers.quantization.input_quant_fp8": stub(
        QuantFP8=placeholder_class("QuantFP8")
    ),
    "vllm.model_executor.layers.quantization.kv_cache": stub(
        BaseKVCacheMethod=placeholder_class("BaseKVCacheMethod")
    ),
    "vllm.model_executor.layers.quantization.compressed_tensors.schemes": (
        _compressed_tensors_schemes
    ),
    "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_embedding": stub(
        CompressedTensorsEmbeddingWNA16Int=placeholder_class("CompressedTensorsEmbeddingWNA16Int")
    ),
    "vllm.model_executor.layers.quantization.compressed_tensors.transform.linear": stub(
        CompressedTensorsLinearTransformMethod=placeholder_class(
            "CompressedTensorsLinearTransformMethod"
        ),
        get_linear_transform_schemes=lambda *args, **kwargs: (None, None),
    ),
}


@dataclass
class _Active:
    release: Release
    source: WheelSource
    importer: EngineImporter


_ACTIVE: _Active | None = None
#: Called before the imported vLLM release changes (vLLM-Ascend's modules, built over vLLM's,
#: unload themselves).
BEFORE_SWITCH: list[Callable[[], None]] = []


def use_vllm(release: Release) -> WheelSource:
    """Make ``release`` the vLLM whose modules ``import vllm...`` gives (downloaded once);
    another release imported before is forgotten first (its modules and every module built over
    them)."""
    global _ACTIVE
    if _ACTIVE is not None and _ACTIVE.release == release:
        return _ACTIVE.source
    if _ACTIVE is not None:
        for hook in BEFORE_SWITCH:
            hook()
        uninstall(_ACTIVE.importer)
        _ACTIVE = None
    source = WheelSource(release)
    importer = EngineImporter({"vllm": source}, REAL, STUBS)
    install(importer)
    _ACTIVE = _Active(release, source, importer)
    return source


def load_vllm() -> WheelSource:
    """The vLLM release imported now (the newest of :data:`RELEASES` if none was chosen)."""
    return use_vllm(_ACTIVE.release if _ACTIVE is not None else VLLM)


def active_release() -> Release:
    """The vLLM release whose code the checks run now."""
    load_vllm()
    assert _ACTIVE is not None
    return _ACTIVE.release


def vllm_packed_modules(arch: str) -> dict[str, tuple[str, ...]]:
    """The ``packed_modules_mapping`` vLLM's quantization configs receive for ``arch``."""
    return dict(PACKED_MODULES[arch])


#: Parameters vLLM's loaders may leave at their initial value (expert biases are zero-initialised
#: and optional in ``AutoGPTQMoEMethod``).
OPTIONAL = frozenset({"w13_bias", "w2_bias"})
#: Checkpoint tensors vLLM 0.33 drops on purpose (``base_config.get_checkpoint_weight_mapper``).
IGNORED_LEAVES = frozenset({"g_idx"})


def quant_config_for(export: Path, arch: str) -> Any:
    """vLLM's quantization config object for an export folder, set up as its model loader does:
    ``from_config(config.json's quantization_config)``, the model class's
    ``packed_modules_mapping`` (``configure_quant_config``) and ``maybe_update_config``."""
    load_vllm()
    hf_config = json.loads((export / "config.json").read_text())["quantization_config"]
    method = hf_config["quant_method"]
    if method == "gptq":
        from vllm.model_executor.layers.quantization.auto_gptq import AutoGPTQConfig

        config: Any = AutoGPTQConfig.from_config(hf_config)
    elif method == "compressed-tensors":
        from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
            CompressedTensorsConfig,
        )

        config = CompressedTensorsConfig.from_config(hf_config)
    else:
        raise ValueError(f"vLLM adapter: unexpected quant_method {method!r}")
    config.packed_modules_mapping = {k: list(v) for k, v in vllm_packed_modules(arch).items()}
    config.maybe_update_config(str(export))
    return config


def resolve(config: Any, module: EngineModule) -> Resolution:
    """Ask vLLM's quantization config about ``module`` and let the chosen method create its
    parameters, as the layer's constructor does."""
    layer = LAYER_CLASSES[module.cls](module)
    try:
        method = (
            config.get_quant_method(layer, prefix=module.prefix) if module.quantizable else None
        )
        if method is None:  # no quant_config, or not handled: the layer's own unquantized method
            method = default_method(module)
        create_weights(method, layer, module)
    except (ValueError, NotImplementedError, RuntimeError, KeyError, AssertionError) as error:
        return Resolution(module, None, error=f"{type(error).__name__}: {error}")
    return Resolution(
        module, type(method).__name__, param_infos(layer), None, OPTIONAL, IGNORED_LEAVES
    )


def create_weights(method: Any, layer: torch.nn.Module, module: EngineModule) -> None:
    """Call ``method.create_weights`` with the arguments the layer's constructor passes
    (``RoutedExperts``, ``VocabParallelEmbedding``, ``LinearBase``) at tensor-parallel size 1."""
    if module.kind == "experts":
        width = module.output_sizes[0]
        method.create_weights(
            layer=layer, num_experts=module.num_experts, hidden_size=module.input_size,
            unpadded_hidden_size=module.input_size, intermediate_size_per_partition=width,
            params_dtype=PARAMS_DTYPE, weight_loader=weight_loader,
            global_num_experts=module.num_experts,
        )  # fmt: skip
    elif module.kind == "lm_head":
        assert isinstance(layer, ParallelLMHead)
        padded = layer.num_embeddings_padded
        method.create_weights(
            layer, layer.embedding_dim, [padded], layer.embedding_dim, padded,
            params_dtype=PARAMS_DTYPE, weight_loader=weight_loader,
        )  # fmt: skip
    else:
        method.create_weights(
            layer, module.input_size, list(module.output_sizes), module.input_size,
            module.output_size, params_dtype=PARAMS_DTYPE, weight_loader=weight_loader,
        )  # fmt: skip


def default_method(module: EngineModule) -> Any:
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    if module.kind == "experts":
        return UnquantizedFusedMoEMethod(RoutedExperts(module).moe_config)
    return UnquantizedEmbeddingMethod() if module.kind == "lm_head" else UnquantizedLinearMethod()


def resolve_export(export: Path, arch: str, modules: list[EngineModule]) -> list[Resolution]:
    """vLLM's decision for every module of an export (a config vLLM rejects raises)."""
    config = quant_config_for(export, arch)
    return [resolve(config, module) for module in modules]
