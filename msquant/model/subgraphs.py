"""Which modules of a decoder layer feed which linear layers: the subgraphs smoothing folds into.

A smoothing scale divides an activation channel where it is produced and multiplies the weight
columns that read it. That is exact only where the producer is a per-channel affine map whose
output goes to nothing but the listed linears: a norm feeding linears (``norm-linear``), a linear
feeding one linear through per-channel operations (``up-down``: the gate's activation multiplies
up_proj's output channel by channel; ``ov``: attention mixes value vectors across tokens, never
across channels; ``linear-linear``: a direct pair). msModelSlim names these four types.

:func:`default_subgraphs` finds them by module names, the norms from the model adapter's
:class:`~msquant.model.norms.NormLayout` (Llama's by default: ``input_layernorm`` ->
``self_attn.{q,k,v}_proj``, ``post_attention_layernorm`` -> ``mlp.{gate,up}_proj``; Gemma 2/3's MLP
reads ``pre_feedforward_layernorm``), ``self_attn.v_proj`` -> ``self_attn.o_proj`` (with the model
config's head counts), ``mlp.up_proj`` -> ``mlp.down_proj``; a layer lacking one of these modules,
or whose MLP is a mixture of experts, simply has fewer subgraphs. An architecture laid out
differently overrides :meth:`msquant.ModelAdapter.smoothing_subgraphs`. Names are only the
hypothesis: the smoothing processors prove each subgraph's data flow on calibration tokens before
folding (:mod:`msquant.check`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from torch import nn

from msquant.model.layers import DecoderLayer
from msquant.model.norms import NormLayout

__all__ = ["SUBGRAPH_TYPES", "SmoothingSubgraph", "SubgraphType", "default_subgraphs"]

#: The kinds of subgraph a smoothing scale is folded into (msModelSlim's ``enable_subgraph_type`` values).
SubgraphType = Literal["norm-linear", "linear-linear", "ov", "up-down"]
#: msModelSlim's subgraph type names, in the order their folds are applied within a layer.
SUBGRAPH_TYPES: tuple[SubgraphType, ...] = ("up-down", "ov", "linear-linear", "norm-linear")


@dataclass(frozen=True)
class SmoothingSubgraph:
    """One producer and the linear layers reading its output (full module names).

    :param kind: the subgraph type (:data:`SUBGRAPH_TYPES`).
    :param source: the producing module: a norm (``norm-linear``) or a linear layer.
    :param targets: the linear layers reading every channel of ``source``'s output; the
        activation statistics are taken at the first one's input.
    :param heads: for ``ov``: the attention heads and the key/value heads (o_proj reads
        ``heads * head_dim`` channels, v_proj writes ``kv_heads * head_dim``).
    :param norm_offset: for ``norm-linear``: the norm scales by ``norm_offset + weight`` (1 for
        the norms of Gemma and Qwen3-Next), so smoothing divides ``norm_offset + weight``, not
        ``weight``. None until known: the model adapter may declare it
        (:attr:`msquant.ModelAdapter.norm_scale_offset`), and the smoothing processors measure it
        on the norm (:func:`msquant.model.norms.measure_norm_form`), refusing a mismatch.
    """

    kind: SubgraphType
    source: str
    targets: tuple[str, ...]
    heads: tuple[int, int] | None = None
    norm_offset: float | None = None


def _linear(layer: nn.Module, name: str) -> bool:
    try:
        return isinstance(layer.get_submodule(name), nn.Linear)
    except AttributeError:
        return False


def _norm(layer: nn.Module, name: str) -> bool:
    try:
        module = layer.get_submodule(name)
    except AttributeError:
        return False
    weight = getattr(module, "weight", None)
    return not isinstance(module, nn.Linear) and weight is not None and weight.dim() == 1


def _heads(model: nn.Module) -> tuple[int, int] | None:
    config = getattr(model, "config", None)
    config = getattr(config, "text_config", None) or config
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if not isinstance(heads, int) or not isinstance(kv_heads, int) or heads % kv_heads:
        return None
    return heads, kv_heads


def default_subgraphs(
    model: nn.Module, layer: DecoderLayer, norms: NormLayout | None = None
) -> list[SmoothingSubgraph]:
    """The smoothing subgraphs of a decoder layer, found by module names (the norms' names from
    ``norms``; Llama's by default)."""
    norms = norms or NormLayout()
    module = layer.module
    prefix = f"{layer.name}."
    found: list[SmoothingSubgraph] = []
    attention = [f"self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")]
    if _norm(module, norms.attention) and all(_linear(module, n) for n in attention):
        found.append(
            SmoothingSubgraph(
                "norm-linear", prefix + norms.attention, tuple(prefix + n for n in attention)
            )
        )
    mlp = ["mlp.gate_proj", "mlp.up_proj"]
    if _norm(module, norms.mlp) and all(_linear(module, n) for n in mlp):
        found.append(
            SmoothingSubgraph("norm-linear", prefix + norms.mlp, tuple(prefix + n for n in mlp))
        )
    heads = _heads(model)
    if (
        heads is not None
        and _linear(module, "self_attn.v_proj")
        and _linear(module, "self_attn.o_proj")
    ):
        found.append(
            SmoothingSubgraph(
                "ov", prefix + "self_attn.v_proj", (prefix + "self_attn.o_proj",), heads
            )
        )
    if _linear(module, "mlp.up_proj") and _linear(module, "mlp.down_proj"):
        found.append(
            SmoothingSubgraph("up-down", prefix + "mlp.up_proj", (prefix + "mlp.down_proj",))
        )
    return found
