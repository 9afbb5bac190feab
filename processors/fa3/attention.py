"""Where FA3 observes: the attention points of the architectures msquant can prove it handles.

msModelSlim's model adapters place FA3's placeholders inside the attention forward
(``inject_fa3_placeholders``). msquant reads the same tensors with forward hooks on the
attention's own submodules, from these per-class descriptions (the architecture knowledge, kept
here as data):

* DeepSeek-V3 MLA (transformers' ``DeepseekV3Attention``, ``model_type`` ``deepseek_v3`` and the
  models built on its class, e.g. Kimi-K2), msModelSlim's ``deepseek_v3`` adapter:

  - ``fa_q``: the query's no-position part absorbed into the latent space, ``q_nope @
    kv_b_proj.weight[h, :qk_nope_head_dim, :]`` per head, shape ``(batch, heads, seq,
    kv_lora_rank)``; ``q_nope`` is read from ``q_b_proj`` (``q_proj`` without a query LoRA),
    ``kv_b_proj``'s weight as it is when the forward runs;
  - ``fa_k`` and ``fa_v``: the normalised latent ``kv_a_layernorm(...)`` as one head,
    ``(batch, 1, seq, kv_lora_rank)`` (MLA's cache holds this latent for keys and values alike);
  - recall ratios 0.9999 for ``fa_q`` / ``fa_k`` and 1.0 for ``fa_v``.

* GLM-5's DSA lightning indexer (transformers' ``GlmMoeDsaIndexer``, ``model_type``
  ``glm_moe_dsa``), msModelSlim's ``glm_5`` adapter: ``fa3_q`` / ``fa3_k`` on the indexer's query
  and key (after its rotary embedding and Hadamard rotation). Only the dynamic (``per_token``)
  scheme is implemented there: it needs no observation, so no hook.

Any other attention class is refused by ``fa3_quant`` (naming the module and this table), since
msquant cannot tell where its query / key / value are.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = [
    "AttentionKind",
    "KINDS",
    "attention_kind",
    "find_attention",
    "observe_mla",
]


@dataclass(frozen=True)
class AttentionKind:
    """One attention class FA3 knows.

    :param class_name: the transformers class (matched with its module, below).
    :param module_prefix: the ``__module__`` its class lives in.
    :param msmodelslim_adapter: msModelSlim's adapter placing the same points.
    :param branches: FA3 branch name -> recall ratio (msModelSlim's placeholder names: ``fa_q``
        for MLA, ``fa3_q`` for GLM-5's indexer; the saver's tensors and the description's act
        letter follow them).
    :param observable: whether msquant can observe the points (the static scheme needs it).
    """

    class_name: str
    module_prefix: str
    msmodelslim_adapter: str
    branches: tuple[tuple[str, float], ...]
    observable: bool


MLA = AttentionKind(
    "DeepseekV3Attention",
    "transformers.models.deepseek_v3.",
    "deepseek_v3",
    (("fa_q", 0.9999), ("fa_k", 0.9999), ("fa_v", 1.0)),
    observable=True,
)
DSA_INDEXER = AttentionKind(
    "GlmMoeDsaIndexer",
    "transformers.models.glm_moe_dsa.",
    "glm_5",
    (("fa3_q", 0.9999), ("fa3_k", 0.9999)),
    observable=False,
)
KINDS: tuple[AttentionKind, ...] = (MLA, DSA_INDEXER)
#: Attention classes that hold a known kind and are no point themselves (class, module prefix).
CONTAINERS = (("GlmMoeDsaAttention", "transformers.models.glm_moe_dsa."),)


def attention_kind(module: nn.Module) -> AttentionKind | None:
    """The FA3 description of ``module``'s class, or None."""
    cls = type(module)
    for kind in KINDS:
        if cls.__name__ == kind.class_name and cls.__module__.startswith(kind.module_prefix):
            return kind
    return None


def _looks_like_attention(module: nn.Module) -> bool:
    """msModelSlim's own test for an attention module: 'Attention' in its class name."""
    return "Attention" in type(module).__name__


def find_attention(
    root: nn.Module, prefix: str
) -> list[tuple[str, nn.Module, AttentionKind | None]]:
    """The modules under ``root`` FA3 acts on: those of a known kind (an indexer inside a known
    attention is listed as itself), and every other module whose class name says Attention,
    with kind None (to be refused). Names are full (``prefix.child``)."""
    found: list[tuple[str, nn.Module, AttentionKind | None]] = []
    for name, module in root.named_modules(prefix=prefix):
        kind = attention_kind(module)
        if kind is not None:
            found.append((name, module, kind))
        elif _looks_like_attention(module) and not _is_container(module):
            found.append((name, module, None))
    return found


def _is_container(module: nn.Module) -> bool:
    """GLM-5's attention: FA3 quantizes its indexer (listed on its own), not the attention;
    msModelSlim's ``glm_5`` adapter leaves an attention without indexer alone as well."""
    cls = type(module)
    return any(
        cls.__name__ == name and cls.__module__.startswith(prefix) for name, prefix in CONTAINERS
    )


def observe_mla(
    attention: nn.Module, observe: Callable[[str, torch.Tensor], None]
) -> list[torch.utils.hooks.RemovableHandle]:
    """Hook ``attention`` (a ``DeepseekV3Attention``) so that every forward calls
    ``observe(branch, tensor)`` for ``fa_q``, ``fa_k`` and ``fa_v`` with msModelSlim's tensors
    (see the module docstring); the forward's own results are left unchanged."""
    mla: Any = attention  # transformers' class: attributes typed by its constructor
    query: nn.Module = mla.q_proj if mla.q_lora_rank is None else mla.q_b_proj
    latent_norm: nn.Module = mla.kv_a_layernorm
    heads, rank = int(mla.num_heads), int(mla.kv_lora_rank)
    nope, rope = int(mla.qk_nope_head_dim), int(mla.qk_rope_head_dim)

    def on_query(_module: nn.Module, _args: object, output: torch.Tensor) -> None:
        batch, seq = output.shape[:2]
        q = output.view(batch, seq, heads, nope + rope).transpose(1, 2)
        q_nope, _ = torch.split(q, [nope, rope], dim=-1)
        weight = mla.kv_b_proj.weight.view(heads, -1, rank)
        observe("fa_q", torch.matmul(q_nope, weight[:, :nope, :]))

    def on_latent(_module: nn.Module, _args: object, output: torch.Tensor) -> None:
        latent = output.unsqueeze(1)
        observe("fa_k", latent)
        observe("fa_v", latent)

    return [
        query.register_forward_hook(on_query),
        latent_norm.register_forward_hook(on_latent),
    ]
