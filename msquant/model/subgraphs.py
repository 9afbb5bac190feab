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
config's head counts), ``mlp.up_proj`` -> ``mlp.down_proj``; in a mixture-of-experts layer the
shared experts' ``mlp.shared_experts.up_proj`` -> ``down_proj`` and one ``up-down`` subgraph per
routed expert, ``mlp.experts.{e}.up_proj`` -> ``mlp.experts.{e}.down_proj`` (msModelSlim's
DeepSeek-V3 / V3.2, GLM-5, Kimi and Qwen3-MoE adapters name the same pairs; its statistics, like
msquant's, are taken on the tokens routed to the expert). A layer lacking one of these modules
simply has fewer subgraphs. An architecture laid out differently overrides
:meth:`msquant.ModelAdapter.smoothing_subgraphs`. Names are only the hypothesis: the smoothing
processors prove each subgraph's data flow on calibration tokens before folding
(:mod:`msquant.check`), except for the routed experts msquant split itself
(:class:`~msquant.model.moe.ExpertMLP`), whose forward ``down_proj(act(gate_proj(x)) *
up_proj(x))`` makes the fold exact by construction (the probe tokens may reach only some experts);
:func:`unknown_expert_modules` names the experts modules of another layout, which a processor
asked to smooth them refuses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from torch import nn

from msquant.model.layers import DecoderLayer
from msquant.model.moe.experts import ExpertMLP
from msquant.model.norms import NormLayout

__all__ = [
    "EXPERT_MLP_FLOW",
    "SUBGRAPH_TYPES",
    "SmoothingSubgraph",
    "SubgraphType",
    "default_subgraphs",
    "expert_subgraphs",
    "unknown_expert_modules",
]

#: The kinds of subgraph a smoothing scale is folded into (msModelSlim's ``enable_subgraph_type`` values).
SubgraphType = Literal["norm-linear", "linear-linear", "ov", "up-down"]
#: msModelSlim's subgraph type names, in the order their folds are applied within a layer.
SUBGRAPH_TYPES: tuple[SubgraphType, ...] = ("up-down", "ov", "linear-linear", "norm-linear")
#: Why an up-down fold inside msquant's own per-expert module keeps the function.
EXPERT_MLP_FLOW = (
    "msquant's ExpertMLP computes down_proj(act(gate_proj(x)) * up_proj(x)): up_proj's output "
    "channel j is read only by down_proj's input channel j"
)


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
    :param exact_by: why the fold keeps the function without a proof on data (the module's
        class fixes the wiring: :data:`EXPERT_MLP_FLOW`), or None: the data flow is proven on the
        probe tokens before folding.
    """

    kind: SubgraphType
    source: str
    targets: tuple[str, ...]
    heads: tuple[int, int] | None = None
    norm_offset: float | None = None
    exact_by: str | None = None


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
    for mlp_name in ("mlp", "mlp.shared_experts"):
        up, down = f"{mlp_name}.up_proj", f"{mlp_name}.down_proj"
        if _linear(module, up) and _linear(module, down):
            found.append(SmoothingSubgraph("up-down", prefix + up, (prefix + down,)))
    found += expert_subgraphs(layer)
    return found


def _experts_modules(layer: DecoderLayer) -> list[tuple[str, nn.Module]]:
    """The routed experts modules of ``layer`` (``mlp.experts``, relative name first)."""
    try:
        return [("mlp.experts", layer.module.get_submodule("mlp.experts"))]
    except AttributeError:
        return []


def _expert_pairs(experts: nn.Module) -> list[tuple[str, nn.Module]] | None:
    """The experts of an experts module (index name, module) when every one holds ``up_proj``
    and ``down_proj`` linear layers, else None."""
    children = [(name, child) for name, child in experts.named_children() if name.isdigit()]
    others = [c for name, c in experts.named_children() if not name.isdigit()]
    if not children or any(True for other in others for _ in other.parameters()):
        return None
    if not all(_linear(child, "up_proj") and _linear(child, "down_proj") for _, child in children):
        return None
    return children


def expert_subgraphs(layer: DecoderLayer) -> list[SmoothingSubgraph]:
    """One ``up-down`` subgraph per routed expert of ``layer`` (``mlp.experts.{e}.up_proj`` ->
    ``mlp.experts.{e}.down_proj``), in expert order; those of msquant's own
    :class:`~msquant.model.moe.ExpertMLP` are exact by construction (:data:`EXPERT_MLP_FLOW`),
    the others (an ``nn.ModuleList`` of MLPs from a model's own code) are proven on data."""
    prefix = f"{layer.name}."
    found = []
    for name, experts in _experts_modules(layer):
        for index, expert in _expert_pairs(experts) or []:
            own = type(expert) is ExpertMLP
            found.append(
                SmoothingSubgraph(
                    "up-down",
                    f"{prefix}{name}.{index}.up_proj",
                    (f"{prefix}{name}.{index}.down_proj",),
                    exact_by=EXPERT_MLP_FLOW if own else None,
                )
            )
    return found


def unknown_expert_modules(layer: DecoderLayer) -> list[str]:
    """Full names of ``layer``'s routed experts modules whose experts are not each an MLP with
    ``up_proj`` and ``down_proj`` linear layers: msquant cannot name their up-down pairs, so it
    cannot smooth them (a processor asked to refuses, naming them)."""
    return [
        f"{layer.name}.{name}"
        for name, experts in _experts_modules(layer)
        if _expert_pairs(experts) is None and any(True for _ in experts.parameters())
    ]
