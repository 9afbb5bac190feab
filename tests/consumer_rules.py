"""How GPTQ consumers decide which layers of a checkpoint are quantized, written for the tests
from their sources (``shared/reference/consumers.md``; vLLM 0.33.0 ``auto_gptq.py`` and
``utils/gptq_utils.py``, optimum 2.3.0 ``gptq/quantizer.py``), independently of msquant:

* vLLM, dense linear layers (and ``lm_head`` with ``lm_head: true``): not quantized when the
  first ``dynamic`` rule matching the layer's name (``re.match``, file order) is negative, or
  when ``modules_in_block_to_quantize`` is set and no entry is a *substring* of the name; a fused
  layer (``qkv_proj``, ``gate_up_proj``) is checked shard by shard and its shards must agree.
* vLLM, MoE experts: one FusedMoE layer per experts module, whose quant method is decided by
  ``dynamic`` alone, looked up with the experts module's name (``model.layers.1.mlp.experts``).
* transformers + optimum: ``dynamic`` is ignored; with ``modules_in_block_to_quantize`` (a list
  of lists, concatenated with ``sum(lists, [])``) a decoder-layer linear is quantized only when
  its name *ends with* an entry.
* SGLang, MoE experts: ``dynamic`` is ignored; every experts module gets the base scheme.
"""

from __future__ import annotations

import re
from typing import Any

#: vLLM's fused linear layers and the checkpoint shards each is built from (Llama, Qwen, Mixtral).
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
SCHEME_KEYS = ("bits", "group_size", "sym", "desc_act")


def first_dynamic_match(config: dict[str, Any], name: str) -> tuple[bool, dict[str, Any]] | None:
    """``(negative, overrides)`` of the first ``dynamic`` rule matching ``name`` in file order."""
    for pattern, overrides in (config.get("dynamic") or {}).items():
        negative = pattern.startswith("-:")
        raw = pattern[2:] if pattern.startswith(("-:", "+:")) else pattern
        if re.match(raw, name):
            return negative, overrides
    return None


def vllm_scheme(config: dict[str, Any], name: str) -> dict[str, Any] | None:
    """The scheme vLLM gives the layer (or FusedMoE experts module) ``name`` from ``dynamic``
    alone; None when a negative rule matches."""
    found = first_dynamic_match(config, name)
    base = {key: config[key] for key in SCHEME_KEYS}
    if found is None:
        return base
    negative, overrides = found
    if negative:
        return None
    return {**base, **{k: v for k, v in overrides.items() if k in SCHEME_KEYS}}


def vllm_listed(config: dict[str, Any], name: str) -> bool:
    """Whether ``modules_in_block_to_quantize`` (absent: every layer) lets vLLM quantize the
    linear layer ``name``; a fused name is checked per shard, and the shards must agree."""
    lists = config.get("modules_in_block_to_quantize")
    if not lists:
        return True
    entries = [entry for inner in lists for entry in inner]
    parent, _, leaf = name.rpartition(".")
    if leaf in FUSED:
        shards = {any(e in f"{parent}.{shard}" for e in entries) for shard in FUSED[leaf]}
        assert len(shards) == 1, f"vLLM: shards of {name} quantized differently"
        return shards.pop()
    return any(entry in name for entry in entries)


def vllm_linear_scheme(config: dict[str, Any], name: str) -> dict[str, Any] | None:
    """The scheme vLLM gives a linear layer (or the head): ``dynamic`` and the list together."""
    if name == "lm_head" and not config.get("lm_head", False):
        return None
    return vllm_scheme(config, name) if vllm_listed(config, name) else None


def optimum_quantized(config: dict[str, Any], name: str) -> bool:
    """Whether transformers + optimum build the decoder-layer linear ``name`` quantized."""
    lists = config.get("modules_in_block_to_quantize")
    if lists is None:
        return True
    entries = sum(lists, [])  # what optimum does: a flat list of strings raises TypeError here
    return any(name.endswith(entry) for entry in entries)


def sglang_moe_scheme(config: dict[str, Any]) -> dict[str, Any]:
    """The scheme SGLang gives every MoE experts module: the base one, ``dynamic`` ignored."""
    return {key: config[key] for key in SCHEME_KEYS}


def vllm_ct_group(config: dict[str, Any], name: str, linear: bool = True) -> str | None:
    """The compressed-tensors config group vLLM gives module ``name`` (None: unquantized).

    ``ignore`` wins (exact name or ``re:``); then a target naming the module (exact or ``re:``);
    then the class target ``Linear``, which only linear layers match (``linear``: False for the
    output head, a ``ParallelLMHead``, which vLLM quantizes only when a target names it).
    """

    def named(entry: str) -> bool:
        if entry.startswith("re:"):
            return re.match(entry[3:], name) is not None
        return entry == name

    if any(named(entry) for entry in config.get("ignore") or []):
        return None
    groups = config["config_groups"]
    for group, body in groups.items():
        if any(named(target) for target in body["targets"]):
            return group
    if linear:
        for group, body in groups.items():
            if "Linear" in body["targets"]:
                return group
    return None
