"""Where each architecture's attention keeps its KV cache (data for ``dynamic_cache``).

The int8 KV cache (C8) quantizes what an attention writes into its cache, and the Ascend export
names its parameters after the projections the keys and values come from
(``<attention>.k_proj.kv_cache_scale``, ``<attention>.v_proj.kv_cache_scale``; msModelSlim 26.1.0's
layout, which vLLM-Ascend reads). msquant names those projections only for the architectures
listed here, where the transformers code was read: the cached keys are ``k_proj``'s output after
the key norm and the rotary embedding, the cached values ``v_proj``'s output, both passed to the
cache's ``update`` once per forward with the attention's ``layer_idx``. At run time
``dynamic_cache`` still checks each attention against that (the projections exist, ``update`` is
called once with the attention's index, the states' channels match the projections' outputs) and
refuses the layer when it does not hold. Any other ``model_type`` is refused with the layer named:
the keys of an attention that caches a compressed latent (DeepSeek's MLA) or shares its KV cache
across layers do not belong to a ``k_proj``, and guessing would export scales for the wrong
tensors.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["KVCacheLayout", "KV_CACHE_LAYOUTS", "kv_cache_layout"]


@dataclass(frozen=True)
class KVCacheLayout:
    """Where one architecture's decoder layer computes what its KV cache stores.

    :param attention: the attention module, relative to the decoder layer.
    :param key: the projection the cached keys come from, relative to the attention.
    :param value: the projection the cached values come from, relative to the attention.
    :param key_path: what happens to the key projection's output before it is cached (for the
        docs and messages).
    """

    attention: str = "self_attn"
    key: str = "k_proj"
    value: str = "v_proj"
    key_path: str = "k_proj -> k_norm -> rotary embedding"


#: ``config.model_type`` -> layout, for the architectures whose attention was read (transformers
#: 5.25: ``Qwen3Attention``, ``Qwen3MoeAttention``, ``MiniMaxM2Attention``, ``LlamaAttention``,
#: ``Qwen2Attention``).
KV_CACHE_LAYOUTS: Mapping[str, KVCacheLayout] = {
    "qwen3": KVCacheLayout(),
    "qwen3_moe": KVCacheLayout(),
    "minimax_m2": KVCacheLayout(),
    "llama": KVCacheLayout(key_path="k_proj -> rotary embedding"),
    "qwen2": KVCacheLayout(key_path="k_proj -> rotary embedding"),
}


def kv_cache_layout(model_type: str) -> KVCacheLayout | None:
    """The KV-cache layout of ``model_type``, None when msquant does not know it."""
    return KV_CACHE_LAYOUTS.get(model_type)
