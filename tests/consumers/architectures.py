"""The modules a serving engine builds for a checkpoint, and the checkpoint tensors each one reads.

vLLM (and vLLM-Ascend, which runs vLLM's model code) and SGLang do not build a model the way
transformers does: q/k/v are one ``qkv_proj``, gate/up one ``gate_up_proj`` (DeepSeek's
``q_a_proj`` + ``kv_a_proj_with_mqa`` one ``fused_qkv_a_proj``), every expert of an MoE block is
one ``FusedMoE`` / ``RoutedExperts`` layer named ``...experts``, and the output head is a
``ParallelLMHead``. A quantization config is consulted once per *engine* module, under the engine's
name, so this is the list a consumer check walks.

The templates below were read in vLLM 0.33.0's ``model_executor/models/{llama,qwen2,qwen3,
qwen3_moe,qwen2_moe,mixtral,deepseek_v2}.py`` and SGLang 0.5.23's ``srt/models/`` files (class of
each layer, its ``prefix``, whether it receives the quantization config); the opt-in suite checks
the fused names against each engine's own ``packed_modules_mapping``. Where the engines differ
(``engine="sglang"``): SGLang fuses DeepSeek's ``q_a_proj`` + ``kv_a_proj_with_mqa`` into a
``ReplicatedLinear`` named ``fused_qkv_a_proj_with_mqa``, whose loader concatenates the two
checkpoint tensors along dimension 0 (``deepseek_weight_loader.py``); it builds every router with
``quant_config=None``; and Mixtral's ``lm_head`` without a quantization config. Sizes come from
the model's ``config.json``; nothing here imports an engine, so the default test suite uses it
too.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

Kind = Literal["linear", "experts", "lm_head"]
Engine = Literal["vllm", "sglang"]

#: vLLM's (and SGLang's) ``packed_modules_mapping`` for the architectures tested.
PACKED_MODULES: dict[str, dict[str, tuple[str, ...]]] = {
    "llama": {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")},
    "qwen2": {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")},
    "qwen3": {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")},
    "mistral": {
        "qkv_proj": ("q_proj", "k_proj", "v_proj"),
        "gate_up_proj": ("gate_proj", "up_proj"),
    },
    "qwen3_moe": {
        "qkv_proj": ("q_proj", "k_proj", "v_proj"),
        "gate_up_proj": ("gate_proj", "up_proj"),
    },
    "qwen2_moe": {
        "qkv_proj": ("q_proj", "k_proj", "v_proj"),
        "gate_up_proj": ("gate_proj", "up_proj"),
    },
    "mixtral": {"qkv_proj": ("q_proj", "k_proj", "v_proj")},
    "deepseek_v3": {
        "gate_up_proj": ("gate_proj", "up_proj"),
        "fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa"),
    },
}

#: SGLang 0.5.23's ``packed_modules_mapping`` (the model class attribute its loader passes to the
#: quantization config; DeepSeek adds its fused a-projection in ``__init__`` when
#: ``q_lora_rank`` is set). Llama, Qwen2-MoE and Mixtral declare none.
SGLANG_PACKED_MODULES: dict[str, dict[str, tuple[str, ...]]] = {
    "llama": {},
    "qwen3_moe": {
        "qkv_proj": ("q_proj", "k_proj", "v_proj"),
        "gate_up_proj": ("gate_proj", "up_proj"),
    },
    "qwen2_moe": {},
    "mixtral": {},
    "deepseek_v3": {"fused_qkv_a_proj_with_mqa": ("q_a_proj", "kv_a_proj_with_mqa")},
}

#: The engine-side model class of each architecture (vLLM and SGLang name them alike).
MODEL_CLASSES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}


@dataclass(frozen=True)
class EngineModule:
    """One module the engine builds and asks its quantization config about.

    :param prefix: the engine's module name (``model.layers.0.self_attn.qkv_proj``).
    :param cls: the engine's class (``QKVParallelLinear``, ``RoutedExperts``, ``ParallelLMHead``).
    :param kind: ``linear`` (any linear layer, routers included), ``experts`` or ``lm_head``.
    :param shards: the checkpoint modules loaded into it, in the engine's shard order (for
        experts: ``experts.<e>.<projection>`` for every expert and projection).
    :param input_size: input features (hidden size for experts and the head).
    :param output_sizes: output features of each shard (vocabulary size for the head; for
        experts: the expert width).
    :param quantizable: whether the engine passes its quantization config to this module (a router
        built with ``quant_config=None`` is always float, whatever the checkpoint says).
    :param num_experts: experts of an ``experts`` module (0 otherwise).
    :param expert_roles: the checkpoint's names of (gate, up, down) for experts modules.
    :param concat_dim: the dimension along which the engine's loader concatenates the shards'
        tensors whatever the parameter's layout (SGLang's DeepSeek a-projection: 0); None: along
        each parameter's output dimension, as the fused linear layers' loaders do.
    """

    prefix: str
    cls: str
    kind: Kind
    shards: tuple[str, ...]
    input_size: int
    output_sizes: tuple[int, ...]
    quantizable: bool = True
    num_experts: int = 0
    expert_roles: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    concat_dim: int | None = None

    @property
    def output_size(self) -> int:
        return sum(self.output_sizes)

    @property
    def leaf(self) -> str:
        return self.prefix.rpartition(".")[2]

    def expert_shard(self, expert: int, role: int) -> str:
        """Checkpoint name of expert ``expert``'s projection ``role`` (0 gate, 1 up, 2 down)."""
        return f"{self.prefix}.{expert}.{self.expert_roles[role]}"


def load_hf_config(model_dir: Path) -> dict[str, Any]:
    """The model's ``config.json``."""
    return json.loads((model_dir / "config.json").read_text())


def _dense_attention(prefix: str, config: dict[str, Any], engine: Engine) -> list[EngineModule]:
    hidden = config["hidden_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    head_dim = config.get("head_dim") or hidden // heads
    attention = f"{prefix}.self_attn"
    return [
        EngineModule(
            f"{attention}.qkv_proj",
            "QKVParallelLinear",
            "linear",
            (f"{attention}.q_proj", f"{attention}.k_proj", f"{attention}.v_proj"),
            hidden,
            (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim),
        ),
        EngineModule(
            f"{attention}.o_proj",
            "RowParallelLinear",
            "linear",
            (f"{attention}.o_proj",),
            heads * head_dim,
            (hidden,),
        ),
    ]


def _mla_attention(prefix: str, config: dict[str, Any], engine: Engine) -> list[EngineModule]:
    """DeepSeek-V2/V3 multi-head latent attention with ``q_lora_rank`` set."""
    hidden = config["hidden_size"]
    heads = config["num_attention_heads"]
    q_rank = config["q_lora_rank"]
    kv_rank = config["kv_lora_rank"]
    rope = config["qk_rope_head_dim"]
    nope = config["qk_nope_head_dim"]
    v_dim = config["v_head_dim"]
    attention = f"{prefix}.self_attn"
    shards = (f"{attention}.q_a_proj", f"{attention}.kv_a_proj_with_mqa")
    if engine == "sglang":
        fused = EngineModule(
            f"{attention}.fused_qkv_a_proj_with_mqa", "ReplicatedLinear", "linear", shards,
            hidden, (q_rank, kv_rank + rope), concat_dim=0,
        )  # fmt: skip
    else:
        fused = EngineModule(
            f"{attention}.fused_qkv_a_proj", "MergedColumnParallelLinear", "linear", shards,
            hidden, (q_rank, kv_rank + rope),
        )  # fmt: skip
    return [
        fused,
        EngineModule(
            f"{attention}.q_b_proj",
            "ColumnParallelLinear",
            "linear",
            (f"{attention}.q_b_proj",),
            q_rank,
            (heads * (nope + rope),),
        ),
        EngineModule(
            f"{attention}.kv_b_proj",
            "ColumnParallelLinear",
            "linear",
            (f"{attention}.kv_b_proj",),
            kv_rank,
            (heads * (nope + v_dim),),
        ),
        EngineModule(
            f"{attention}.o_proj",
            "RowParallelLinear",
            "linear",
            (f"{attention}.o_proj",),
            heads * v_dim,
            (hidden,),
        ),
    ]


def _gated_mlp(prefix: str, hidden: int, width: int) -> list[EngineModule]:
    return [
        EngineModule(
            f"{prefix}.gate_up_proj",
            "MergedColumnParallelLinear",
            "linear",
            (f"{prefix}.gate_proj", f"{prefix}.up_proj"),
            hidden,
            (width, width),
        ),
        EngineModule(
            f"{prefix}.down_proj",
            "RowParallelLinear",
            "linear",
            (f"{prefix}.down_proj",),
            width,
            (hidden,),
        ),  # fmt: skip
    ]


def _experts(
    prefix: str,
    hidden: int,
    width: int,
    count: int,
    roles: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
) -> EngineModule:
    shards = tuple(f"{prefix}.{e}.{role}" for e in range(count) for role in roles)
    return EngineModule(
        prefix, "RoutedExperts", "experts", shards, hidden, (width,), num_experts=count,
        expert_roles=roles,
    )  # fmt: skip


def _router(
    prefix: str, hidden: int, experts: int, quantizable: bool, cls: str = "GateLinear"
) -> EngineModule:
    return EngineModule(prefix, cls, "linear", (prefix,), hidden, (experts,), quantizable)


def _is_moe_layer(arch: str, index: int, config: dict[str, Any]) -> bool:
    if arch in ("qwen3_moe", "qwen2_moe"):
        step = config.get("decoder_sparse_step", 1) or 1
        return index not in config.get("mlp_only_layers", []) and (index + 1) % step == 0
    if arch == "mixtral":
        return True
    if arch == "deepseek_v3":
        return index >= config.get("first_k_dense_replace", 0)
    return False


def _expert_count(config: dict[str, Any]) -> int:
    """Routed experts (transformers 5 saves Qwen-MoE's ``num_experts`` as ``num_local_experts``)."""
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        if config.get(key):
            return int(config[key])
    raise ValueError("config.json names no expert count")


def _mlp(arch: str, prefix: str, config: dict[str, Any], engine: Engine) -> list[EngineModule]:
    """The MLP block of decoder layer ``prefix`` (dense or MoE)."""
    hidden = config["hidden_size"]
    index = int(prefix.rpartition(".")[2])
    if not _is_moe_layer(arch, index, config):
        return _gated_mlp(f"{prefix}.mlp", hidden, config["intermediate_size"])
    if arch == "mixtral":
        moe = f"{prefix}.block_sparse_moe"
        count = _expert_count(config)
        return [
            _router(f"{moe}.gate", hidden, count, quantizable=False),
            _experts(
                f"{moe}.experts", hidden, config["intermediate_size"], count, ("w1", "w3", "w2")
            ),
        ]
    moe = f"{prefix}.mlp"
    width = config["moe_intermediate_size"]
    if arch == "qwen3_moe":
        count = _expert_count(config)
        # vLLM passes quant_config to Qwen3-MoE's GateLinear; SGLang builds it with None
        return [
            _router(f"{moe}.gate", hidden, count, quantizable=engine == "vllm"),
            _experts(f"{moe}.experts", hidden, width, count),
        ]
    if arch == "qwen2_moe":
        count = _expert_count(config)
        modules = [
            _router(f"{moe}.gate", hidden, count, quantizable=False),
            _experts(f"{moe}.experts", hidden, width, count),
            _router(
                f"{moe}.shared_expert_gate", hidden, 1, quantizable=False, cls="ReplicatedLinear"
            ),
        ]
        shared = config.get("shared_expert_intermediate_size", 0)
        if shared:
            modules[2:2] = _gated_mlp(f"{moe}.shared_expert", hidden, shared)
        return modules
    if arch == "deepseek_v3":
        count = _expert_count(config)
        modules = [
            _router(f"{moe}.gate", hidden, count, quantizable=False),
            _experts(f"{moe}.experts", hidden, width, count),
        ]
        shared = config.get("n_shared_experts") or 0
        if shared:
            modules += _gated_mlp(f"{moe}.shared_experts", hidden, width * shared)
        return modules
    raise ValueError(f"no MoE template for {arch}")


def engine_modules(model_dir: Path, engine: Engine = "vllm") -> list[EngineModule]:
    """Every module ``engine`` asks its quantization config about, for the checkpoint in
    ``model_dir`` (``config.json`` only), in model order; the output head last (absent when tied:
    the engines tie it to the embeddings and never look its quantization up)."""
    config = load_hf_config(model_dir)
    arch = config["model_type"]
    if arch not in PACKED_MODULES:
        raise ValueError(f"no engine template for model_type {arch!r}")
    modules: list[EngineModule] = []
    for index in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{index}"
        attention = _mla_attention if arch == "deepseek_v3" else _dense_attention
        modules += attention(prefix, config, engine)
        modules += _mlp(arch, prefix, config, engine)
    if not config.get("tie_word_embeddings", False):
        hidden, vocab = config["hidden_size"], config["vocab_size"]
        # SGLang's MixtralForCausalLM builds its head without the quantization config
        quantizable = not (engine == "sglang" and arch == "mixtral")
        modules.append(
            EngineModule(
                "lm_head",
                "ParallelLMHead",
                "lm_head",
                ("lm_head",),
                hidden,
                (vocab,),
                quantizable,
            )  # fmt: skip
        )
    return modules


def sglang_packed_modules(arch: str) -> dict[str, tuple[str, ...]]:
    """The ``packed_modules_mapping`` SGLang's quantization configs receive for ``arch``."""
    return dict(SGLANG_PACKED_MODULES[arch])


def checkpoint_modules(modules: list[EngineModule]) -> Iterator[str]:
    """Every checkpoint module the engine modules read (shards, experts' projections)."""
    for module in modules:
        yield from module.shards


_LAYER_INDEX = re.compile(r"\.layers\.(\d+)\.")


def layer_of(name: str) -> int | None:
    """The decoder layer index in a module name (None outside the layers)."""
    match = _LAYER_INDEX.search(f".{name}.")
    return None if match is None else int(match[1])
