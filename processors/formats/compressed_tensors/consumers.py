"""What SGLang and older compressed-tensors releases cannot load from a compressed-tensors export,
and how transformers loads it, as messages (pure; the saver logs them)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from importlib.metadata import PackageNotFoundError, version

from msquant.processors.formats.compressed_tensors.config import WeightScheme

__all__ = [
    "MX_SCHEMES",
    "VLLM_MX_WEIGHT_ONLY",
    "ASCEND_MX_RELEASES",
    "W4A8_MXFP_REFUSAL",
    "mx_plan_findings",
    "SGLANG_BITS",
    "DENSE_PACKING_BITS",
    "transformers_loading_note",
    "consumer_warnings",
    "activation_warnings",
]

#: Widths SGLang's compressed-tensors WNA16 scheme loads.
SGLANG_BITS = (4, 8)
#: Widths whose dense packing (across int32 words) needs compressed-tensors >= 0.18.
DENSE_PACKING_BITS = (3, 5, 6, 7)
SGLANG_BITS_WARNING = (
    "SGLang 0.5.23 loads compressed-tensors weight-only layers of 4 or 8 bits only; these layers "
    "are {kinds} and do not load there: {names} (vLLM loads 2-8 bits)"
)
PACKING_WARNING = (
    "{kinds} layers are packed densely across int32 words, the layout of compressed-tensors 0.18 "
    "and later; compressed-tensors 0.17 and earlier pack {widths}-bit weights otherwise, and vLLM "
    "0.33 / 0.34 pin compressed-tensors 0.17.0: a loader that unpacks with compressed-tensors 0.17 "
    "(transformers with it fails to load this export) needs compressed-tensors >= 0.18 installed; "
    "vLLM 0.33 / 0.34 creates parameters of the dense shapes for these widths (its kernels were not run "
    "on them here); 4 or 8 bits avoid both: {names}"
)

VLLM_ASYM_ZERO_POINT = (
    "static asymmetric activations: vLLM 0.33 / 0.34's CUTLASS int8 kernel rebuilds each layer's input "
    "zero point from its range with a truncating conversion, which can move it one step toward "
    "0 (observed on 1 of 8 layers of a tiny Llama: that layer's output then differs by about "
    "one activation step); symmetric static or per-token activations avoid it: {names}"
)
TRANSFORMERS_W8A8_EXPERTS = (
    "int8 W8A8 MoE experts: transformers {version} (5.24 and 5.25 checked) fuses each MoE block's "
    "experts into one experts.gate_up_proj / experts.down_proj when it loads a checkpoint, and "
    "its compressed-tensors conversion finds none of these experts' tensors to fuse "
    "(RuntimeError: issues during automatic conversion of the weights), so "
    "AutoModelForCausalLM.from_pretrained cannot load this export; vLLM can (SGLang cannot on a "
    "GPU); for transformers keep the experts float (exclude ['*mlp.experts.*']): {names}"
)
TRANSFORMERS_DYNAMIC = (
    "per-token activations: transformers (compressed-tensors) simulates them with its own step "
    "max|x| / 127.5, vLLM's kernels and msquant eval with max|x| / 127, so its logits differ "
    "slightly from the deployed model's"
)


#: The MX activation schemes this format writes (msModelSlim's names, as plans show them).
MX_SCHEMES = ("W8A8_MXFP8", "W4A4_MXFP4")
VLLM_MX_WEIGHT_ONLY = (
    "MX layers: vLLM 0.33 / 0.34 quantize their activations to MX only on SM100+ (Blackwell) "
    "GPUs with FlashInfer; below, they pick a weight-only Marlin kernel (MXFP8 W8A16, MXFP4 "
    "W4A16: activations stay in the model's float dtype; kernels/linear/__init__.py:569-579, "
    "626-633, kernels/linear/mxfp8/marlin.py:14, kernels/linear/mxfp4/marlin.py:29-36 of 0.34.0); "
    "MoE experts alike: the MXFP8 MoE method's first kernels need SM100 (FlashInfer TRT-LLM, "
    "DeepGEMM: fused_moe/experts/trtllm_fp8_moe.py:174-181, deep_gemm_moe.py:184-187), then "
    "Marlin, and the MXFP4 one takes Marlin (W4A16) unless vLLM's CUTLASS MXFP4 experts kernel "
    "supports the GPU (compressed_tensors_moe_w4a4_mxfp4.py:67, 84-86, 170; Marlin's MoE kernel "
    "checks the weights' type only, fused_moe/experts/marlin_moe.py:548-567), "
    "so msquant eval (which simulates MX activations, msModelSlim's scheme, as vLLM-Ascend "
    "0.30's W8A8_MXFP8 / W4A4_MXFP4 run them) measures what Blackwell and Ascend compute, not "
    "what an older GPU computes: {names}"
)
ASCEND_MX_RELEASES = (
    "vLLM-Ascend reads MX compressed-tensors layers from 0.30.0rc2 on (W8A8_MXFP8 / W4A4_MXFP4: "
    "quantization/configs/compressed_tensors_config.py:346-364, the top-level format "
    "mixed-precision keeping their input activations, :128-138); 0.26.0rc1 refuses them: it drops "
    "the input activations of MX groups (quantization/compressed_tensors_config.py:137-149), then "
    "finds no MXFP8 type (NotImplementedError, :381) and takes MXFP4 as weight-only W4A8_MXFP, whose "
    "linear scheme does not take use_weight_packed (TypeError, :338-339), while MXFP4 MoE experts "
    "load as W4A8_MXFP with MXFP8 activations, not the MXFP4 ones msquant computes "
    "(methods/w4a8_mxfp4.py:99-105): {names}"
)
W4A8_MXFP_REFUSAL = (
    "W4A8_MXFP (mxfp4 weights, mxfp8 activations) has no compressed-tensors reading as MXFP8 "
    "activations: vLLM 0.33 / 0.34 take mxfp4 weights with 8-bit float dynamic group inputs as "
    "CompressedTensorsW4A8Mxfp4 with FP8 (float-scaled) group activations, not MX "
    "(compressed_tensors.py:459-489, 806-809), and vLLM-Ascend 0.30.0rc2 matches MX groups only "
    "with equal weight and input widths and raises NotImplementedError otherwise "
    "(quantization/configs/compressed_tensors_config.py:346-382, 384-401); export W4A8_MXFP with "
    "type: ascendv1_saver (msModelSlim's layout): {names}"
)


def mx_plan_findings(acts: Mapping[str, str]) -> tuple[list[str], list[str]]:
    """``(errors, warnings)`` for the MX layers of a plan, ``acts`` quantized module name ->
    activation scheme (msModelSlim's name): W4A8_MXFP is refused (no engine reads it from
    compressed-tensors as msquant computes it), W8A8_MXFP8 / W4A4_MXFP4 warned about (vLLM
    below SM100 runs them weight-only, vLLM-Ascend 0.26.0rc1 refuses them)."""
    errors, warnings = [], []
    w4a8 = [name for name, act in acts.items() if act == "W4A8_MXFP"]
    if w4a8:
        errors.append(W4A8_MXFP_REFUSAL.format(names=_listing(w4a8)))
    mx = [name for name, act in acts.items() if act in MX_SCHEMES]
    if mx:
        warnings.append(VLLM_MX_WEIGHT_ONLY.format(names=_listing(mx)))
        warnings.append(ASCEND_MX_RELEASES.format(names=_listing(mx)))
    return errors, warnings


def activation_warnings(schemes: Mapping[str, WeightScheme]) -> list[str]:
    """What vLLM 0.33 / 0.34 loads differently among the int8 W8A8 modules (static activations on
    MoE experts are refused by ``linear_quant`` itself; vLLM's int8 MoE method is per-token only),
    and what transformers cannot load (int8 W8A8 MoE experts).
    What SGLang does with them is warned about at plan time
    (:mod:`msquant.processors.sglang_limits`: static scales unused, MoE experts refused on GPUs)."""
    warnings = []
    asym = [n for n, s in schemes.items() if s.input_strategy == "tensor" and not s.input_symmetric]
    if asym:
        warnings.append(VLLM_ASYM_ZERO_POINT.format(names=_listing(asym)))
    experts = [
        n
        for n, s in schemes.items()
        if s.input_strategy is not None and s.value_type is None and ".experts." in n
    ]
    if experts:
        warnings.append(
            TRANSFORMERS_W8A8_EXPERTS.format(
                version=_transformers_version(), names=_listing(experts)
            )
        )
    return warnings


def _transformers_version() -> str:
    """The installed transformers' version (the loader the warning is about)."""
    try:
        return version("transformers")
    except PackageNotFoundError:  # not installed here: the message still holds for 5.24 / 5.25
        return "5.x"


def transformers_loading_note(schemes: Iterable[WeightScheme]) -> str:
    """How transformers can load an export holding ``schemes`` (formats.md 4.1; vLLM loads all)."""
    distinct = set(schemes)
    if any(scheme.is_mx for scheme in distinct):
        # compressed-tensors 0.20's MX decompressors give bfloat16 weights (decompress_mx_scale)
        return (
            "transformers (compressed-tensors 0.20) loads it with AutoModelForCausalLM."
            "from_pretrained(path, dtype=torch.bfloat16): it decompresses MX weights to bfloat16, "
            "and a float32 model then fails on the dtype mismatch"
        )
    symmetric = all(scheme.symmetric for scheme in distinct)
    dynamic = any(s.input_strategy == "token" and s.value_type is None for s in distinct)
    if symmetric:
        note = "transformers loads it with AutoModelForCausalLM.from_pretrained(path)"
        return f"{note}; {TRANSFORMERS_DYNAMIC}" if dynamic else note
    if len(distinct) == 1:
        return (
            "asymmetric: transformers loads it only with "
            "quantization_config=CompressedTensorsConfig(dequantize=True)"
        )
    return (
        "asymmetric mixed precision: transformers cannot load it (its default loader rejects "
        "packed zero points; dequantize=True decompresses every layer with one group's scheme); "
        "vLLM can"
    )


def _listing(names: list[str], shown: int = 6) -> str:
    more = len(names) - shown
    return ", ".join(names[:shown]) + (f" and {more} more" if more > 0 else "")


def consumer_warnings(schemes: Mapping[str, WeightScheme]) -> list[str]:
    """What SGLang and compressed-tensors 0.17 (pinned by vLLM 0.33 / 0.34) do not load among the
    quantized modules ``schemes`` (name -> scheme, in model order)."""
    warnings = []
    odd = {name: s for name, s in schemes.items() if s.num_bits not in SGLANG_BITS}
    if odd:
        kinds = ", ".join(sorted({f"int{s.num_bits}" for s in odd.values()}))
        warnings.append(SGLANG_BITS_WARNING.format(kinds=kinds, names=_listing(list(odd))))
    dense = {name: s for name, s in schemes.items() if s.num_bits in DENSE_PACKING_BITS}
    if dense:
        widths = sorted({s.num_bits for s in dense.values()})
        warnings.append(
            PACKING_WARNING.format(
                kinds=", ".join(f"int{b}" for b in widths),
                widths="/".join(str(b) for b in widths),
                names=_listing(list(dense)),
            )
        )
    return warnings
