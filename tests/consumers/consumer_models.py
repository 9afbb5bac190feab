"""Tiny models for the consumer checks, sized so that the engines' GPU kernels would accept them.

Marlin (vLLM's and SGLang's GPTQ kernels) wants ``in_features % 128 == 0`` and
``out_features % 64 == 0``; its MoE kernel wants a hidden size that is a multiple of 128 and an
expert width divisible by the group size; a quantized head wants ``vocab_size % 64 == 0``. Hidden
128, MLP 256, experts 128 wide and a 384-token vocabulary satisfy all of them, so what the
engines' code decides for these models is what it decides for a real one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import transformers
from packaging.version import Version
from tiny_models import build_tiny_model

#: transformers' MoE layouts differ before 5.24 (as in tests/conftest.py).
NEEDS_MOE_TRANSFORMERS = pytest.mark.skipif(
    Version(transformers.__version__) < Version("5.24"),
    reason=f"MoE support is tested with transformers >= 5.24, not {transformers.__version__}",
)

#: The architectures of the consumer matrix.
CONSUMER_ARCHS = ("llama", "qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3")

HIDDEN = 128
INTERMEDIATE = 256
EXPERT_WIDTH = 128
EXPERTS = 4

#: Overrides of tests/tiny_models.py's architectures.
CONSUMER_OVERRIDES: dict[str, dict[str, Any]] = {
    "llama": {},
    "qwen3_moe": dict(head_dim=32, moe_intermediate_size=EXPERT_WIDTH, num_experts=EXPERTS),
    "qwen2_moe": dict(
        moe_intermediate_size=EXPERT_WIDTH,
        shared_expert_intermediate_size=EXPERT_WIDTH,
        num_experts=EXPERTS,
    ),
    # Mixtral's experts are `intermediate_size` wide
    "mixtral": dict(intermediate_size=EXPERT_WIDTH, num_local_experts=EXPERTS),
    "deepseek_v3": dict(
        moe_intermediate_size=EXPERT_WIDTH,
        n_routed_experts=EXPERTS,
        n_group=2,
        topk_group=1,
        q_lora_rank=64,
        kv_lora_rank=64,
        qk_rope_head_dim=16,
        qk_nope_head_dim=16,
        v_head_dim=32,
    ),
}


def build_consumer_model(directory: Path, arch: str, **overrides: Any) -> Path:
    """A 2-layer random ``arch`` model (float32, untied head) sized for the engines' kernels."""
    params: dict[str, Any] = dict(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_layers=2)
    params.update(CONSUMER_OVERRIDES[arch])
    params.update(overrides)
    return build_tiny_model(directory, arch, **params)
