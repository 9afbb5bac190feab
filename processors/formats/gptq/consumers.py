"""What vLLM, SGLang and transformers cannot load from a GPTQ checkpoint, as messages (pure
functions over the saver's rule units; the saver logs them, or raises them under ``strict``)."""

from __future__ import annotations

from msquant.plugin.model import parse_expert_linear
from msquant.processors.formats.gptq.config import (
    RuleUnit,
    experts_module_units,
    is_experts_unit,
)
from msquant.processors.formats.gptq.packer import CT_ALTERNATIVE
from msquant.processors.formats.gptq.scheme import CheckpointFormat, GPTQScheme, listing

__all__ = [
    "VOCAB_PADDING",
    "DYNAMIC_WARNING",
    "SKIPPED_NOTE",
    "VOCAB_WARNING",
    "vllm_problem_message",
    "marlin_problem_message",
    "sglang_moe_message",
    "transformers_random_message",
]

MARLIN_OUT_MULTIPLE = 64
MARLIN_IN_MULTIPLE = 128
MARLIN_GROUP_SIZES = (-1, 32, 64, 128)

#: vLLM / SGLang pad the vocabulary to a multiple of this; a quantized head of another size does
#: not load into the padded parameters (``vocab_parallel_embedding.py``'s weight loader).
VOCAB_PADDING = 64

DYNAMIC_WARNING = (
    "the layers are not all quantized alike, so the checkpoint carries GPTQModel `dynamic` rules "
    "with other bits / group sizes / symmetry; vLLM, SGLang and GPTQModel apply them, but "
    "transformers (optimum) ignores them and expects every quantized linear layer of the decoder "
    "layers in the base scheme, so it cannot load this checkpoint; for transformers use "
    "`type: compressed_tensors`"
)

SKIPPED_NOTE = (
    "some linear layers of the decoder layers stay in float: `-:` rules in `dynamic` (vLLM, "
    "SGLang, GPTQModel) and the quantized ones in modules_in_block_to_quantize (transformers + "
    "optimum, vLLM)"
)

SGLANG_MOE_WARNING = (
    "the MoE experts of {experts} are stored {what}, which only `dynamic` rules say; SGLang's "
    "GPTQ MoE method ignores `dynamic` and builds every experts module with the base scheme "
    "({base}), then skips the checkpoint tensors that do not fit, serving uninitialised experts: "
    "SGLang cannot serve this checkpoint (vLLM and GPTQModel.load read the rules)"
)

TRANSFORMERS_RANDOM_WARNING = (
    "transformers + optimum (gptqmodel) load this checkpoint without an error but leave {what} "
    "randomly initialised (optimum replaces only the nn.Linear layers of the decoder layers; "
    "transformers 5 MoE experts are not nn.Linear): GPTQModel.load and vLLM load {them} "
    "correctly; for transformers export `type: compressed_tensors`, which transformers loads "
    "{them} from"
)

VOCAB_WARNING = (
    "{head} is quantized, but its {vocab} output rows (the vocabulary) are not a multiple of "
    f"{VOCAB_PADDING}: vLLM and SGLang pad the vocabulary to a multiple of {VOCAB_PADDING} and "
    "cannot load GPTQ head tensors of another width (qweight / qzeros / scales [..., {vocab}]); "
    "GPTQModel loads it; to serve with vLLM or SGLang set lm_head: false"
)


def vllm_problem_message(units: list[RuleUnit], checkpoint_format: CheckpointFormat) -> str | None:
    """Why vLLM 0.33 / 0.34 / SGLang cannot serve these units as GPTQ (None when they can)."""
    bad = [u for u in units if u.scheme is not None and not u.scheme.vllm_servable]
    if not bad:
        return None
    kinds = sorted({u.scheme.describe() for u in bad if u.scheme is not None})
    members = [name for unit in bad for name in unit.members]
    message = (
        f"{listing(members)} ({', '.join(kinds)}): vLLM 0.33 / 0.34 and SGLang serve GPTQ checkpoints "
        "only 4- or 8-bit symmetric (transformers with optimum + gptqmodel and GPTQModel load "
        f"this one); for vLLM {CT_ALTERNATIVE}"
    )
    if checkpoint_format == "gptq" and any(not u.scheme.sym for u in bad if u.scheme is not None):
        message += (
            ". GPTQModel also refuses sym=false checkpoints in the v1 `gptq` format that gptqmodel "
            "did not make: set `checkpoint_format: gptq_v2` (transformers + optimum load both)"
        )
    return message


def marlin_problem_message(units: list[RuleUnit]) -> str | None:
    """Which quantized units do not fit the Marlin GPTQ kernels, and what each engine does with
    them (None if all fit).

    vLLM 0.33 / 0.34 refuses group sizes Marlin has no kernel for, and zero-pads layers whose widths are
    not whole Marlin tiles (``out % 64``, ``in % 128``); SGLang 0.5.23 has no other CUDA GPTQ
    kernel for such group sizes, and runs Marlin on misaligned layers without its shape check.
    MoE experts are not checked: vLLM picks their kernels per experts module (Marlin MoE, or its
    MoE WNA16 kernels when Marlin does not fit).
    """
    groups, shapes = [], []
    for unit in units:
        if unit.scheme is None or parse_expert_linear(unit.members[0]) is not None:
            continue
        shape = f"{unit.name} [out {unit.out_features}, in {unit.in_features}, group_size "
        shape += f"{unit.scheme.group_size}]"
        if unit.scheme.group_size not in MARLIN_GROUP_SIZES:
            groups.append(shape)
        elif unit.out_features % MARLIN_OUT_MULTIPLE or unit.in_features % MARLIN_IN_MULTIPLE:
            shapes.append(shape)
    parts = []
    if groups:
        parts.append(
            f"group sizes Marlin has no kernel for (it takes {list(MARLIN_GROUP_SIZES)}): "
            f"{listing(groups)}; vLLM 0.33 / 0.34 refuses such layers (ValueError) and SGLang has no "
            "other CUDA GPTQ kernel, so neither serves this checkpoint; "
            "`type: compressed_tensors` (pack-quantized) is vLLM's other weight-only format"
        )
    if shapes:
        parts.append(
            f"widths that are not whole Marlin tiles (out_features % {MARLIN_OUT_MULTIPLE}, "
            f"in_features % {MARLIN_IN_MULTIPLE}, at tensor-parallel size 1): "
            f"{listing(shapes)}; vLLM 0.33 / 0.34 zero-pads them to whole tiles and loads the "
            "checkpoint, but SGLang 0.5.23 runs its Marlin kernels on them without checking "
            "(its shape check's result is unused), so do not serve this checkpoint with SGLang"
        )
    if not parts:
        return None
    return "Marlin GPTQ kernels (vLLM, SGLang): " + "; ".join(parts)


def sglang_moe_message(units: list[RuleUnit], base: GPTQScheme) -> str | None:
    """Why SGLang cannot serve the MoE experts of these units (None when it can): its GPTQ MoE
    method ignores ``dynamic``, so every experts module must be quantized with the base scheme."""
    odd = [u for u in experts_module_units(units) if is_experts_unit(u) and u.scheme != base]
    if not odd:
        return None
    kinds = sorted({"in float" if u.scheme is None else f"as {u.scheme.describe()}" for u in odd})
    return SGLANG_MOE_WARNING.format(
        experts=listing([u.name for u in odd]), what=" / ".join(kinds), base=base.describe()
    )


def transformers_random_message(units: list[RuleUnit], head: RuleUnit | None) -> str | None:
    """What transformers + optimum load without error but randomly initialised: a quantized head,
    quantized MoE experts (None when neither is exported)."""
    parts = []
    if any(is_experts_unit(u) and u.scheme is not None for u in experts_module_units(units)):
        parts.append("the MoE experts")
    if head is not None and head.scheme is not None:
        parts.append(f"the quantized output head ({head.name})")
    if not parts:
        return None
    them = "them" if len(parts) > 1 or parts[0].endswith("experts") else "it"
    return TRANSFORMERS_RANDOM_WARNING.format(what=" and ".join(parts), them=them)
