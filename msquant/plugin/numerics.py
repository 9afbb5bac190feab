"""The pure numerics a processor or method calls: integer and MX quantization of a weight
(min-max, MSE clipping, Hessian-aware clipping, GPTQ), the code and scale arithmetic of the
export formats (deq_scale, int4 and nibble packing), the smoothing scales and their folding,
and the Hadamard rotations. Every one is a function of tensors (or a small accumulator of
statistics): no model walking, no run state. Part of the plugin API (docs/api.md).
"""

from msquant.quant.activation import (
    OnlineMinMax,
)
from msquant.quant.clip_search import (
    hessian_clip_qparams,
    quantize_weight_hessian_clip,
)
from msquant.quant.gptq import (
    GPTQQuantizer,
    WeightPerChannelGPTQ,
    WeightPerGroupGPTQ,
)
from msquant.quant.gptq_options import (
    GPTQOptions,
)
from msquant.quant.gptq_solver import (
    GPTQResult,
    gptq_quantize,
    resolve_block_size,
)
from msquant.quant.hessian import (
    HessianAccumulator,
)
from msquant.quant.int_quant import (
    compute_qparams,
    dequantize,
    minmax_qparams,
    qrange,
)
from msquant.quant.int_quant import (
    quantize as quantize_codes,
)
from msquant.quant.minifloat import (
    pack_nibbles,
    unpack_nibbles,
)
from msquant.quant.minmax import (
    check_weight,
    divisors,
    quantize_weight_minmax,
)
from msquant.quant.mse_clip import (
    MSEOptions,
    mse_minmax_qparams,
    mse_qparams,
)
from msquant.quant.mx_quant import (
    E8M0_BIAS,
    e8m0_bytes,
    e8m0_scale,
)
from msquant.quant.output_error import (
    relative_output_errors,
)
from msquant.quant.rotation import (
    DEFAULT_ROTATION_SEED,
    fuse_norm_into_linear,
    hadamard_core_order,
    is_power_of_two,
    rotate_input,
    rotate_output,
    rotation_for,
)
from msquant.quant.smoothing import (
    abs_column_max,
    flex_scales,
    fold_into_linear_columns,
    fold_into_linear_rows,
    fold_into_norm,
    iter_scales,
    iter_weight_stat,
    ov_scales_max,
    ov_scales_mean,
    search_alpha_beta,
    update_channel_max,
)
from msquant.quant.value_types import (
    value_type_named,
)
from msquant.quant.w8a8_params import (
    decode_deq_scale,
    deq_scale,
    encode_deq_scale,
    pack_int4_rows,
    quant_bias,
    scale_bias,
    unpack_int4_rows,
)

__all__ = [
    "OnlineMinMax",
    "HessianAccumulator",
    "relative_output_errors",
    "value_type_named",
    "pack_nibbles",
    "unpack_nibbles",
    "E8M0_BIAS",
    "e8m0_bytes",
    "e8m0_scale",
    "decode_deq_scale",
    "deq_scale",
    "encode_deq_scale",
    "quant_bias",
    "scale_bias",
    "pack_int4_rows",
    "unpack_int4_rows",
    "quantize_weight_minmax",
    "quantize_weight_hessian_clip",
    "hessian_clip_qparams",
    "GPTQQuantizer",
    "GPTQOptions",
    "WeightPerChannelGPTQ",
    "WeightPerGroupGPTQ",
    "GPTQResult",
    "gptq_quantize",
    "resolve_block_size",
    "check_weight",
    "divisors",
    "compute_qparams",
    "minmax_qparams",
    "MSEOptions",
    "mse_qparams",
    "mse_minmax_qparams",
    "quantize_codes",
    "dequantize",
    "qrange",
    "abs_column_max",
    "flex_scales",
    "fold_into_linear_columns",
    "fold_into_linear_rows",
    "fold_into_norm",
    "iter_scales",
    "iter_weight_stat",
    "ov_scales_max",
    "ov_scales_mean",
    "search_alpha_beta",
    "update_channel_max",
    "fuse_norm_into_linear",
    "hadamard_core_order",
    "is_power_of_two",
    "rotate_input",
    "rotate_output",
    "rotation_for",
    "DEFAULT_ROTATION_SEED",
]
