"""Mixture-of-experts models as per-expert ``nn.Linear`` layers.

transformers (5.x) holds the routed experts of an MoE block FUSED: one module (``Qwen2MoeExperts``,
``MixtralExperts``, ``DeepseekV3Experts``, ...) with 3-D parameters ``gate_up_proj [E, 2I, H]`` and
``down_proj [E, H, I]``. Checkpoints on disk, and the engines that load them (vLLM, vLLM-Ascend,
SGLang), name every expert projection separately (``mlp.experts.3.gate_proj.weight``, Mixtral's
``block_sparse_moe.experts.3.w1.weight``); transformers converts between the two when it loads
and saves (``transformers.conversion_mapping``). Some checkpoints keep the experts fused on disk
(Qwen3-VL-MoE: ``experts.gate_up_proj`` / ``experts.down_proj``, transposed in the released
checkpoints); msquant then names the per-expert layers ``experts.3.gate_proj`` etc., as
msModelSlim exports them and the engines load them.

msquant quantizes ``nn.Linear`` modules and calibrates GPTQ through hooks on them, so this package
(one job per module):

- :mod:`~msquant.model.moe.layout` finds the fused experts modules and refuses a layout it cannot
  reproduce;
- :mod:`~msquant.model.moe.unfuse` replaces each by an :class:`UnfusedExperts`
  (:mod:`~msquant.model.moe.experts`) holding one :class:`ExpertMLP` per expert, with the same
  forward, so a hook on an expert's Linear sees exactly the tokens routed to that expert;
- :mod:`~msquant.model.moe.routers` names the routers, which stay float;
- :mod:`~msquant.model.moe.token_counts` counts the tokens each expert receives during
  calibration and decides from that count whether GPTQ can be trusted for an expert.

The disk names of the per-expert layers come from :mod:`msquant.model.checkpoint_names`.
"""

from msquant.model.moe.experts import ExpertMLP, UnfusedExperts
from msquant.model.moe.layout import find_fused_experts
from msquant.model.moe.routers import moe_routers
from msquant.model.moe.token_counts import (
    DEFAULT_EXPERT_TOKEN_RATIO,
    ExpertTokenCounter,
    enough_expert_tokens,
)
from msquant.model.moe.unfuse import MoEInfo, UnfusedMoE, unfuse_experts

__all__ = [
    "DEFAULT_EXPERT_TOKEN_RATIO",
    "ExpertMLP",
    "ExpertTokenCounter",
    "MoEInfo",
    "UnfusedExperts",
    "UnfusedMoE",
    "enough_expert_tokens",
    "find_fused_experts",
    "moe_routers",
    "unfuse_experts",
]
