"""Tiny models of every causal-LM architecture transformers ships, built from configs (no download),
for the transform sweep (tests/processors/test_transform_sweep.py).

:func:`tiny_causal_lm` shrinks an architecture's default config (width 64, 2 layers, 4 heads of 16,
4 experts of 32, ...) and builds it on the meta device first, so that an architecture whose config
keeps a large part the shrinking does not reach is skipped before it allocates anything.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

#: Every model type with a causal-LM class in the installed transformers.
CAUSAL_LM_TYPES = sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
VOCAB = 384
#: Largest model the sweep builds (a tiny config that stays bigger keeps an unshrunk part).
MAX_PARAMETERS = 3_000_000

#: Applied where the config has the attribute (and it is writable).
SHRINK: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_layers=2,
    n_layer=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    n_shared_experts=1,
    n_group=1,
    topk_group=1,
    first_k_dense_replace=1,
    bos_token_id=0,
    eos_token_id=0,
    pad_token_id=0,
    tie_word_embeddings=False,
)
#: Multi-head latent attention (DeepSeek-V2/V3 and its descendants): heads 8 + 8 wide for the
#: queries and keys (the rotary part 8), values 16.
MLA = dict(kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)
#: Per-architecture settings the shrinking needs besides.
EXTRA: dict[str, dict[str, Any]] = {
    "codegen": dict(rotary_dim=8),
    "gptj": dict(rotary_dim=8),
}


def _set(config: Any, values: dict[str, Any]) -> None:
    for key, value in values.items():
        if hasattr(config, key):
            try:
                setattr(config, key, value)
            except (AttributeError, TypeError, ValueError):
                pass  # a derived, read-only attribute


def tiny_config(model_type: str) -> tuple[Any | None, str]:
    """The shrunk config of ``model_type``, or None and why the sweep leaves it out."""
    config = AutoConfig.for_model(model_type)
    if getattr(config, "is_encoder_decoder", False):
        return None, "encoder-decoder"
    if any(
        getattr(config, key, None) is not None
        for key in ("vision_config", "audio_config", "speech_config")
    ):
        return None, "multimodal"
    _set(config, SHRINK)
    if hasattr(config, "qk_rope_head_dim"):
        _set(config, MLA)
        _set(config, dict(head_dim=MLA["qk_rope_head_dim"]))
    else:
        _set(config, dict(head_dim=16))
    _set(config, EXTRA.get(model_type, {}))
    types = getattr(config, "layer_types", None)
    if isinstance(types, list) and len(types) > 2:
        # keep two layers of different kinds where the architecture mixes them
        kinds = list(dict.fromkeys(types))
        _set(config, dict(layer_types=(kinds * 2)[:2]))
    return config, ""


def tiny_causal_lm(model_type: str, seed: int = 0) -> tuple[nn.Module | None, str]:
    """A float32 tiny model of ``model_type`` with random norm gains (so that folding them
    matters), or None and why it cannot be built tiny."""
    try:
        config, reason = tiny_config(model_type)
        if config is None:
            return None, reason
        with torch.device("meta"):
            meta = AutoModelForCausalLM.from_config(config)
        size = sum(p.numel() for p in meta.parameters())
        if size > MAX_PARAMETERS:
            return None, f"not tiny ({size} parameters)"
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config).float().eval()
    except Exception as error:  # noqa: BLE001 - an architecture this shrinking cannot build
        return None, f"cannot be built tiny: {type(error).__name__}: {str(error)[:120]}"
    generator = torch.Generator().manual_seed(seed + 3)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name.lower() and parameter.dim() == 1:
                parameter.copy_(torch.rand(parameter.shape, generator=generator) + 0.5)
    return model, ""
