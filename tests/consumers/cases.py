"""The exports the consumer tests check (issue 13 §1), shared by the engine test files."""

from __future__ import annotations

from exports import (
    LAYER1_EXPERTS,
    LAYER1_EXPERTS_8BIT,
    ExportCase,
    gptq_weight,
    minmax_weight,
)

MOE_ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3")
#: Layer 1's MLP in int8 (its down_proj too), layer 0's down_proj in float.
MIXED_RULES = {r"model\.layers\.1\.mlp\..*": {"bits": 8}}
LAYER0_DOWN = ("model.layers.0.mlp.down_proj",)
#: Layer 0's q/k/v in float (a fused layer in `ignore`).
LAYER0_QKV = tuple(f"model.layers.0.self_attn.{p}_proj" for p in "qkv")
HEAD_8BIT = {"lm_head": {"bits": 8, "group_size": -1}}


def _gptq(name: str, arch: str = "llama", **kwargs: object) -> ExportCase:
    weight = kwargs.pop("weight", gptq_weight())
    return ExportCase(name, arch, "gptq_saver", weight, **kwargs)  # type: ignore[arg-type]


def _ct(name: str, arch: str = "llama", **kwargs: object) -> ExportCase:
    weight = kwargs.pop("weight", gptq_weight())
    return ExportCase(name, arch, "compressed_tensors", weight, **kwargs)  # type: ignore[arg-type]


def _ascend(name: str, arch: str = "llama", **kwargs: object) -> ExportCase:
    weight = kwargs.pop("weight", minmax_weight())
    return ExportCase(name, arch, "ascendv1_saver", weight, **kwargs)  # type: ignore[arg-type]


GPTQ_SERVED = {
    case.name: case
    for case in (
        _gptq("gptq_int4_g128"),
        _gptq("gptq_int8_channel", weight=gptq_weight(8, None)),
        _gptq("gptq_neg_rules_only", exclude=LAYER0_DOWN),
        _gptq("gptq_mixed", exclude=LAYER0_DOWN, dynamic=MIXED_RULES),
        _gptq("gptq_head_same_scheme", lm_head=True),
        _gptq("gptq_head_other_scheme", lm_head=True, dynamic=HEAD_8BIT),
        *(_gptq(f"gptq_moe_{arch}", arch, weight=gptq_weight(group=64)) for arch in MOE_ARCHS),
    )
}
#: §1 #1: experts of layer 1 left float / in int8 under per-module rules.
GPTQ_MOE_RULES = {
    case.name: case
    for arch in MOE_ARCHS
    for case in (
        _gptq(
            f"gptq_moe_float_experts_{arch}",
            arch,
            weight=gptq_weight(group=64),
            exclude=LAYER1_EXPERTS,
        ),
        _gptq(
            f"gptq_moe_int8_experts_{arch}",
            arch,
            weight=gptq_weight(group=64),
            dynamic=LAYER1_EXPERTS_8BIT,
        ),
    )  # fmt: skip
}
#: What vLLM 0.33 / SGLang cannot serve as GPTQ at all.
GPTQ_UNSERVABLE = {
    "gptq_asym": _gptq("gptq_asym", weight=gptq_weight(group=128, sym=False)),
    "gptq_int3": _gptq("gptq_int3", dynamic={r".*": {"bits": 3}}),
}

CT_SERVED = {
    case.name: case
    for case in (
        _ct("ct_int4_g128"),
        _ct("ct_int8_channel", weight=gptq_weight(8, None)),
        _ct("ct_mixed", exclude=LAYER0_DOWN, dynamic=MIXED_RULES),
        _ct("ct_float_qkv", exclude=LAYER0_QKV),
        _ct("ct_asym", weight=gptq_weight(group=64, sym=False)),
        _ct("ct_head_other_scheme", lm_head=True, dynamic=HEAD_8BIT),
        *(_ct(f"ct_moe_{arch}", arch, weight=gptq_weight(group=64)) for arch in MOE_ARCHS),
        *(
            _ct(
                f"ct_moe_float_experts_{arch}",
                arch,
                weight=gptq_weight(group=64),
                exclude=LAYER1_EXPERTS,
            )
            for arch in MOE_ARCHS
        ),  # fmt: skip
    )
}
CT_INT3 = _ct("ct_int3", dynamic={r".*": {"bits": 3}})
CT_HEAD_SAME = _ct("ct_head_same_scheme", lm_head=True)

ASCEND = {
    case.name: case
    for case in (
        _ascend("ascend_w8a16_sym"),
        _ascend("ascend_w8a16_asym", weight=minmax_weight(sym=False)),
        _ascend("ascend_w8a16_per_group", weight=minmax_weight(group=64)),
        _ascend("ascend_w4a16", weight=minmax_weight("int4", group=64)),
        _ascend("ascend_w8a16_head", lm_head=True),
        *(_ascend(f"ascend_w8a16_moe_{arch}", arch) for arch in MOE_ARCHS),
    )
}

#: A 4-bit export whose layer-1 MLP has a 3-bit rule (SGLang's per-layer bit check).
GPTQ_INT3_MLP = _gptq("gptq_int4_int3_mlp", dynamic={r"model\.layers\.1\.mlp\..*": {"bits": 3}})
#: Mixtral with a quantized head (SGLang's MixtralForCausalLM builds its head without the
#: quantization config).
HEAD_MIXTRAL = {
    "gptq": _gptq("gptq_head_mixtral", "mixtral", weight=gptq_weight(group=64), lm_head=True),
    "ct": _ct("ct_head_mixtral", "mixtral", weight=gptq_weight(group=64), lm_head=True),
}

#: §1 #4: a quantized head whose vocabulary (400) is not a multiple of 64.
VOCAB_400 = (("vocab_size", 400),)
HEAD_VOCAB_400 = {
    "gptq": _gptq("gptq_head_vocab400", lm_head=True, model=VOCAB_400),
    "ct": _ct("ct_head_vocab400", lm_head=True, model=VOCAB_400),
}

#: §1 #5 / #12: MLP 160 wide, so down_proj's 160 input features are not a whole Marlin tile
#: (in % 128) while every other layer is aligned; group 32 divides 160.
MISALIGNED_MODEL = (("intermediate_size", 160),)
GPTQ_MISALIGNED = _gptq("gptq_misaligned", weight=gptq_weight(group=32), model=MISALIGNED_MODEL)
