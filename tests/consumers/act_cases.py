"""The activation-scheme exports the consumer tests check (issue 16): ``linear_quant`` with
``qconfig.act`` (W8A8 static sym / asym, W8A8_DYNAMIC, W4A8_DYNAMIC), written as compressed-tensors
(vLLM) and in msModelSlim's layout (vLLM-Ascend)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from cases import MOE_ARCHS
from exports import ExportCase, minmax_weight


def act(scope: str = "per_token", symmetric: bool = True) -> dict[str, Any]:
    """An int8 ``qconfig.act`` (``minmax``): ``per_token`` (dynamic) or ``per_tensor`` (static)."""
    return {"dtype": "int8", "scope": scope, "symmetric": symmetric, "method": "minmax"}


@dataclass(frozen=True)
class ActExportCase(ExportCase):
    """An :class:`ExportCase` whose ``linear_quant`` step also quantizes activations."""

    act: dict[str, Any] = field(default_factory=act)

    def config(self) -> dict[str, Any]:
        config = super().config()
        config["spec"]["process"][0]["qconfig"]["act"] = dict(self.act)
        return config


def _case(name: str, saver: str, arch: str = "llama", **kwargs: Any) -> ActExportCase:
    weight = kwargs.pop("weight", minmax_weight())
    return ActExportCase(name, arch, saver, weight, **kwargs)


STATIC_SYM, STATIC_ASYM, DYNAMIC = (
    act("per_tensor", True),
    act("per_tensor", False),
    act("per_token", True),
)
INT4 = minmax_weight("int4")
#: A bfloat16 consumer model: W8A8's deq_scale is then stored float32 (int64 float32 bits for
#: float16 and float32 models), the dtype vLLM-Ascend creates for bfloat16 serving.
BF16 = (("dtype", torch.bfloat16),)

#: compressed-tensors int8 W8A8 for vLLM's CompressedTensorsW8A8Int8 (dense and MoE models).
CT_W8A8 = {
    case.name: case
    for case in (
        _case("ct_w8a8_static_sym", "compressed_tensors", act=STATIC_SYM),
        _case("ct_w8a8_static_asym", "compressed_tensors", act=STATIC_ASYM),
        _case("ct_w8a8_dynamic", "compressed_tensors", act=DYNAMIC),
        *(
            _case(f"ct_w8a8_dynamic_moe_{arch}", "compressed_tensors", arch, act=DYNAMIC)
            for arch in MOE_ARCHS
        ),
    )
}
#: msModelSlim-layout exports for vLLM-Ascend's W8A8, W8A8_DYNAMIC and W4A8_DYNAMIC schemes.
ASCEND_ACT = {
    case.name: case
    for case in (
        _case("ascend_w8a8_static_sym", "ascendv1_saver", act=STATIC_SYM),
        _case("ascend_w8a8_static_asym", "ascendv1_saver", act=STATIC_ASYM),
        _case("ascend_w8a8_static_sym_bf16", "ascendv1_saver", act=STATIC_SYM, model=BF16),
        _case("ascend_w8a8_static_asym_bf16", "ascendv1_saver", act=STATIC_ASYM, model=BF16),
        _case("ascend_w8a8_dynamic", "ascendv1_saver", act=DYNAMIC),
        _case("ascend_w4a8_dynamic", "ascendv1_saver", act=DYNAMIC, weight=INT4),
        *(
            _case(f"ascend_w8a8_dynamic_moe_{arch}", "ascendv1_saver", arch, act=DYNAMIC)
            for arch in MOE_ARCHS
        ),
        *(
            _case(
                f"ascend_w4a8_dynamic_moe_{arch}", "ascendv1_saver", arch, act=DYNAMIC, weight=INT4
            )
            for arch in MOE_ARCHS
        ),  # fmt: skip
    )
}


@dataclass(frozen=True)
class GroupedBesideW4A8Case(ActExportCase):
    """W4A8_DYNAMIC routed experts (per-channel) and, in a second ``linear_quant`` step, per-group
    W8A16 attention: the description's one global ``group_size`` becomes the group's size."""

    def config(self) -> dict[str, Any]:
        config = super().config()
        config["spec"]["process"][0]["include"] = ["*.experts.*"]
        config["spec"]["process"].append(
            {
                "type": "linear_quant",
                "include": ["*self_attn*"],
                "qconfig": {"weight": minmax_weight("int8", group=32)},
            }
        )
        return config


#: W4A8_DYNAMIC experts beside per-group W8A16 layers (vLLM-Ascend 0.30 refuses the experts).
ASCEND_W4A8_GROUPED = GroupedBesideW4A8Case(
    "ascend_w4a8_moe_beside_grouped_w8a16", "qwen3_moe", "ascendv1_saver", INT4, act=DYNAMIC
)

#: compressed-tensors int8 W8A8 exports only the SGLang suite checks: DeepSeek's a-projections
#: with static activations (routed experts left float: msquant refuses static activations there).
CT_W8A8_SGLANG = {
    case.name: case
    for case in (
        _case(
            "ct_w8a8_static_deepseek_v3",
            "compressed_tensors",
            "deepseek_v3",
            act=STATIC_SYM,
            exclude=("*mlp.experts.*",),
        ),
    )
}
