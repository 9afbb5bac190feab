"""The loader rules of a GPTQ checkpoint as a whole, checked once every layer was read.

vLLM, SGLang, GPTQModel and transformers + optimum each decide from ``quantization_config`` which
modules they build quantized and how; these checks compare those decisions with what the export
stores (``shared/reference/formats.md`` 3.1): ``dynamic`` rules against the fused names the
exported model's adapter knows (``qkv_proj``; Qwen3.5's ``in_proj_qkvz``) and against MoE experts
module names, ``modules_in_block_to_quantize`` against the stored layers, and what transformers
mis-loads. The per-layer decoding and its checks are :mod:`~msquant.processors.formats.gptq.reader`'s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from msquant.processors.formats.gptq.reader import GPTQReader, GPTQStoredScheme

__all__ = ["check_loader_rules"]

SGLANG_MOE = (
    "SGLang's GPTQ MoE method ignores quantization_config.dynamic and builds every experts module "
    "in the base scheme ({base}), skipping the tensors that do not fit: it cannot serve the "
    "experts stored otherwise ({experts})"
)
TRANSFORMERS_RANDOM = (
    "transformers + optimum load {what} of a GPTQ checkpoint without an error but randomly "
    "initialised; GPTQModel.load and vLLM load {them}, transformers loads {them} from "
    "compressed-tensors"
)
TRANSFORMERS_SKIPPED = (
    "quantization_config.dynamic keeps some layers in float but modules_in_block_to_quantize is "
    "missing: transformers + optimum build those layers quantized and fail at the first forward"
)


def check_loader_rules(reader: GPTQReader) -> None:
    """Record, in ``reader.findings``, what the loaders make of the checkpoint as a whole."""
    _check_asym_v1_meta(reader)
    _check_fused_prefixes(reader)
    sglang_moe = _check_experts_modules(reader)
    _check_modules_in_block(reader)
    _note_transformers(reader, sglang_moe)


def _check_asym_v1_meta(reader: GPTQReader) -> None:
    if reader.v2 or not any(
        (s := reader.resolve(m)) is not None and not s.sym for m in reader.modules
    ):
        return
    meta = reader.qconfig.get("meta")
    quantizer = meta.get("quantizer") if isinstance(meta, dict) else None
    names = quantizer if isinstance(quantizer, list) else [quantizer]
    if not any(isinstance(n, str) and n.startswith("gptqmodel:") for n in names):
        reader.findings.warn(
            "GPTQModel refuses asymmetric v1 'gptq' checkpoints unless meta.quantizer names "
            "gptqmodel >= 0.9.0; write checkpoint_format gptq_v2"
        )


def _check_fused_prefixes(reader: GPTQReader) -> None:
    """vLLM matches ``dynamic`` against the fused name (``qkv_proj``), not the shards'."""
    if not reader.dynamic:
        return
    for group in reader.adapter.fused_groups(reader.modules):
        shard = reader.resolve(group.members[0])
        if shard is None or not all(reader.resolve(m) == shard for m in group.members):
            continue  # differing shards are reported by the fused-shard check
        fused = reader.resolve(group.fused_name)
        if fused != shard:
            seen = "excluded" if fused is None else fused.describe()
            reader.findings.error(
                f"{group.fused_name}: vLLM matches quantization_config.dynamic against the "
                f"fused name and gets {seen}, but its shards {list(group.members)} are stored "
                f"as {shard.describe()}"
            )


def _check_experts_modules(reader: GPTQReader) -> bool:
    """vLLM looks ``dynamic`` up by the experts module's name: it must resolve as the experts
    are stored. Returns whether SGLang (base scheme for every experts module) cannot serve
    them, after noting it."""
    if reader.base is None:
        return False
    odd = []
    for group in reader.adapter.expert_groups(reader.linear_names()):
        stored = {reader.stored_scheme(member) for member in group.members}
        if len(stored) > 1:
            continue  # experts differing among themselves: the FusedMoE rule is broken anyway
        (scheme,) = stored
        seen = reader.resolve(group.fused_name)
        if seen != scheme:
            reader.findings.error(
                f"{group.fused_name}: vLLM matches quantization_config.dynamic against the "
                f"experts module's name and resolves it {_describe(seen)}, but its "
                f"{len(group.members)} expert linear layers are stored {_describe(scheme)} "
                "(a rule matching the experts module name is missing)"
            )
        if scheme != reader.base:
            odd.append(f"{group.fused_name}: {_describe(scheme)}")
    if odd:
        reader.findings.warn(
            SGLANG_MOE.format(base=reader.base.describe(), experts="; ".join(odd[:4]))
        )
    return bool(odd)


def _check_modules_in_block(reader: GPTQReader) -> None:
    """``modules_in_block_to_quantize``: a list of lists of names; transformers + optimum keep
    a decoder linear float unless its name ends with an entry, vLLM unless an entry is in it
    (the head too, with ``lm_head: true``); MoE experts are matched by ``dynamic`` in vLLM."""
    if "modules_in_block_to_quantize" not in reader.qconfig:
        if any(negative for _, negative, _, _ in reader.dynamic):
            reader.findings.warn(TRANSFORMERS_SKIPPED)
        return
    value = reader.qconfig["modules_in_block_to_quantize"]
    if not isinstance(value, list) or not all(
        isinstance(inner, list) and all(isinstance(n, str) for n in inner) for inner in value
    ):
        reader.findings.error(
            "quantization_config.modules_in_block_to_quantize must be a list of lists of "
            f"module names (transformers + optimum concatenate the inner lists), got {value!r}"
        )
        return
    entries = [name for inner in value for name in inner]
    for module in reader.linear_names():
        if reader.adapter.expert_linear(module) is not None:
            continue  # vLLM resolves experts by `dynamic`; transformers 5 experts are no Linear
        listed = any(entry in module for entry in entries)
        ends = any(module.endswith(entry) for entry in entries)
        quantized = module in reader.modules
        if quantized and not listed:
            reader.findings.error(
                f"{module} is stored quantized but no modules_in_block_to_quantize entry "
                "names it: vLLM and transformers + optimum load it as a float layer"
            )
        elif quantized and not ends and module != "lm_head":
            reader.findings.error(
                f"{module} is stored quantized but no modules_in_block_to_quantize entry is "
                "a suffix of its name: transformers + optimum load it as a float layer"
            )
        elif not quantized and (listed or ends):
            reader.findings.error(
                f"{module} is stored in float but modules_in_block_to_quantize names it: "
                "vLLM and transformers + optimum expect its GPTQ tensors"
            )


def _note_transformers(reader: GPTQReader, sglang_moe: bool) -> None:
    """What transformers + optimum mis-load: ``dynamic`` scheme overrides (ignored), a
    quantized head and MoE experts (random weights)."""
    if any(not negative and overrides for _, negative, _, overrides in reader.dynamic):
        where = "GPTQModel and vLLM" if sglang_moe else "GPTQModel, vLLM and SGLang"
        reader.findings.warn(
            "transformers + optimum ignore the bits / group_size / sym overrides of "
            f"quantization_config.dynamic: this checkpoint loads correctly only in {where}"
        )
    experts = any(reader.adapter.expert_linear(m) for m in reader.modules)
    what = [name for name, found in (("the MoE experts", experts),) if found]
    if "lm_head" in reader.modules:
        what.append("the quantized lm_head")
    if what:
        them = "them" if experts else "it"
        reader.findings.warn(TRANSFORMERS_RANDOM.format(what=" and ".join(what), them=them))


def _describe(scheme: GPTQStoredScheme | None) -> str:
    return "in float" if scheme is None else f"as {scheme.describe()}"
