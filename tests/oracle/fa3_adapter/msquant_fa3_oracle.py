"""A msModelSlim model adapter for the FA3 oracle (loaded by msModelSlim, never by msquant).

msModelSlim 26.1.0's own ``deepseek_v3`` adapter cannot run on a CPU: it loads DeepSeek's remote
modeling code (``modeling_deepseek.py``, whose attention API its rewritten forward calls), adds
the MTP layer and moves modules to ``"npu"`` for it. This adapter is its default adapter plus
``inject_fa3_placeholders`` for transformers' ``DeepseekV3Attention``: the same placeholders
(``fa_q`` / ``fa_k`` / ``fa_v``, ratios 0.9999 / 0.9999 / 1.0) called with the same tensors as
the ``deepseek_v3`` adapter's rewritten forward (the absorbed ``q_nope``, the normalised
``compressed_kv`` as one head), through forward hooks that leave the forward unchanged. So the
oracle compares msModelSlim's FA3 processor, observer, qparams and saver with msquant's; where
the placeholders sit is this file's reading of msModelSlim's adapter, written independently of
msquant's ``processors/fa3/attention.py``.

Registered through the ``msmodelslim.model_adapter.plugins`` entry point of the dist-info beside
it (the folder goes on msModelSlim's ``PYTHONPATH``): ``--model_type msquant-fa3-oracle``.
"""

import torch
from msmodelslim.model.default.model_adapter import DefaultModelAdapter
from msmodelslim.model.interface_hub import FA3QuantAdapterInterface, FA3QuantPlaceHolder


class FA3OracleAdapter(DefaultModelAdapter, FA3QuantAdapterInterface):
    def inject_fa3_placeholders(self, root_name, root_module, should_inject):
        for name, module in list(root_module.named_modules()):
            if type(module).__name__ != "DeepseekV3Attention":
                continue
            full = f"{root_name}.{name}" if root_name else name
            if not should_inject(full):
                continue
            root_module.set_submodule(f"{name}.fa_q", FA3QuantPlaceHolder(ratio=0.9999))
            root_module.set_submodule(f"{name}.fa_k", FA3QuantPlaceHolder(ratio=0.9999))
            root_module.set_submodule(f"{name}.fa_v", FA3QuantPlaceHolder(ratio=1.0))
            _hook(module)


def _hook(attn):
    query = attn.q_b_proj if attn.q_lora_rank is not None else attn.q_proj

    def on_query(_module, _args, q):
        bsz, q_len = q.shape[:2]
        q = q.view(bsz, q_len, attn.num_heads, attn.qk_head_dim).transpose(1, 2)
        q_nope, _ = torch.split(q, [attn.qk_nope_head_dim, attn.qk_rope_head_dim], dim=-1)
        kv_b = attn.kv_b_proj.weight.view(attn.num_heads, -1, attn.kv_lora_rank)
        attn.fa_q(torch.matmul(q_nope, kv_b[:, : attn.qk_nope_head_dim, :]))

    def on_latent(_module, _args, compressed_kv):
        attn.fa_k(compressed_kv.unsqueeze(1))
        attn.fa_v(compressed_kv.unsqueeze(1))

    query.register_forward_hook(on_query)
    attn.kv_a_layernorm.register_forward_hook(on_latent)
