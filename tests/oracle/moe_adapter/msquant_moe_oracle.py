"""A msModelSlim model adapter for the routed-experts ``flex_awq_ssz`` oracle (loaded by
msModelSlim, never by msquant).

msModelSlim 26.1.0's ``deepseek_v3_2`` and ``glm_5`` adapters (the ``--model_type`` of the
DeepSeek-V3.2 and GLM-5 / 5.1 W4A8 practices) cannot run on a CPU with tiny transformers models:
they build the model from their own modeling code (``model.py``, with DeepSeek's sparse-attention
indexer and the MTP layer) and load real checkpoints' names. And under transformers 5.24 (the
oracle environment) the tiny models hold their routed experts fused (3-D ``gate_up_proj`` /
``down_proj``), which no msModelSlim adapter splits for these families: its default adapter leaves
them float. This adapter is the default adapter plus:

* the experts of every ``DeepseekV3Experts`` / ``Glm4MoeExperts`` split into one MLP per expert
  (``experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj`` linear layers) computing what the fused
  module computes, each expert getting its routed tokens in token order, as transformers 4.57's
  DeepSeek-V3 MoE and msModelSlim's own ``model.py`` give them;
* ``FlexSmoothQuantInterface`` answering the up-down subgraphs of the ``deepseek_v3_2`` / ``glm_5``
  adapters' ``get_adapter_config_for_subgraph``: ``mlp.up_proj -> mlp.down_proj`` below
  ``first_k_dense_replace``, then ``mlp.shared_experts.up_proj -> down_proj`` and one
  ``mlp.experts.{e}.up_proj -> down_proj`` per routed expert (their norm-linear and ov entries
  name MLA / indexer modules and are left out: the oracle's entries smooth up-down only).

So the oracle compares msModelSlim's ``flex_awq_ssz`` processor (statistics hooked on each
expert's ``down_proj``, search, scales, fold), ``linear_quant`` and saver with msquant's. Written
independently of msquant's ``msquant/model/moe``.

Registered through the ``msmodelslim.model_adapter.plugins`` entry point of the dist-info beside
it (the folder goes on msModelSlim's ``PYTHONPATH``): ``--model_type msquant-moe-oracle``.
"""

import torch
from msmodelslim.core.const import DeviceType
from msmodelslim.core.graph import AdapterConfig, MappingConfig
from msmodelslim.model.default.model_adapter import DefaultModelAdapter
from msmodelslim.model.interface_hub import FlexSmoothQuantInterface
from torch import nn

FUSED = ("DeepseekV3Experts", "Glm4MoeExperts")


class _Expert(nn.Module):
    def __init__(self, gate, up, down):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = gate, up, down


def _linear(weight):
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype)
    linear.weight = nn.Parameter(weight.detach().clone(), requires_grad=False)
    return linear


class SplitExperts(nn.ModuleList):
    """One MLP per expert, called like the fused module: (tokens, top-k experts, top-k weights)."""

    def __init__(self, fused):
        inter = fused.down_proj.shape[2]
        super().__init__(
            _Expert(
                _linear(fused.gate_up_proj[e, :inter]),
                _linear(fused.gate_up_proj[e, inter:]),
                _linear(fused.down_proj[e]),
            )
            for e in range(fused.gate_up_proj.shape[0])
        )
        self.act_fn = fused.act_fn

    def forward(self, hidden_states, top_k_index, top_k_weights):
        final = torch.zeros_like(hidden_states)
        for e, expert in enumerate(self):
            token_idx, top_k_pos = torch.where(top_k_index == e)  # token order
            if token_idx.numel() == 0:
                continue
            x = hidden_states[token_idx]
            out = expert.down_proj(self.act_fn(expert.gate_proj(x)) * expert.up_proj(x))
            out = out * top_k_weights[token_idx, top_k_pos, None]
            final.index_add_(0, token_idx, out.to(final.dtype))
        return final


def split_experts(model):
    for name, module in list(model.named_modules()):
        if type(module).__name__ in FUSED:
            model.set_submodule(name, SplitExperts(module))
    return model


class MoEOracleAdapter(DefaultModelAdapter, FlexSmoothQuantInterface):
    def init_model(self, device=DeviceType.NPU):
        return split_experts(super().init_model(device))

    def load_model(self, device=DeviceType.NPU):
        return split_experts(super().load_model(device))

    def get_adapter_config_for_subgraph(self):
        config = self.config
        found = []

        def up_down(layer, mlp):
            mapping = MappingConfig(
                source=f"model.layers.{layer}.{mlp}.up_proj",
                targets=[f"model.layers.{layer}.{mlp}.down_proj"],
            )
            found.append(AdapterConfig(subgraph_type="up-down", mapping=mapping))

        for layer in range(config.num_hidden_layers):
            if layer < config.first_k_dense_replace:
                up_down(layer, "mlp")
                continue
            up_down(layer, "mlp.shared_experts")
            for expert in range(config.n_routed_experts):
                up_down(layer, f"mlp.experts.{expert}")
        return found
