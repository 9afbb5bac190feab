"""What SGLang and older compressed-tensors releases cannot load from a compressed-tensors export,
and how transformers loads it, as messages (pure; the saver logs them)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from importlib.metadata import PackageNotFoundError, version

from msquant.processors.formats.compressed_tensors.config import WeightScheme

__all__ = [
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
