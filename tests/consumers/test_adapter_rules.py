"""vLLM 0.33.0's own GPTQ rule matching on a Qwen3.5 export with mixed rules.

vLLM builds Qwen3.5's Gated DeltaNet projections as two fused matrices (``in_proj_qkvz``,
``in_proj_ba``: the ``packed_modules_mapping`` of its ``qwen3_5.py``) and matches ``dynamic``
against those names. The real ``get_dynamic_override``, ``is_layer_gptq_quantized`` and
``override_config`` (``utils/gptq_utils.py``) must give every module vLLM builds the scheme its
shards are stored in. Opt-in (``pytest -m consumers``): downloads the wheel once.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import vllm_engine
from safetensors import safe_open

import msquant

pytestmark = [pytest.mark.consumers, pytest.mark.usefixtures("vllm")]

#: vLLM 0.33's ``Qwen3_5ForCausalLM.packed_modules_mapping`` (``models/qwen3_5.py``).
QWEN3_5_PACKED = {
    "qkv_proj": ["q_proj", "k_proj", "v_proj"],
    "gate_up_proj": ["gate_proj", "up_proj"],
    "in_proj_qkvz": ["in_proj_qkv", "in_proj_z"],
    "in_proj_ba": ["in_proj_b", "in_proj_a"],
}
#: The modules vLLM builds for the tiny model's two layers (linear attention, full attention).
VLLM_MODULES = [
    "model.layers.0.linear_attn.in_proj_qkvz",
    "model.layers.0.linear_attn.in_proj_ba",
    "model.layers.0.linear_attn.out_proj",
    "model.layers.0.mlp.gate_up_proj",
    "model.layers.0.mlp.down_proj",
    "model.layers.1.self_attn.qkv_proj",
    "model.layers.1.self_attn.o_proj",
    "model.layers.1.mlp.gate_up_proj",
    "model.layers.1.mlp.down_proj",
]
W4_G32 = {"dtype": "int4", "scope": "per_group", "symmetric": True, "method": "minmax"}
W8_CH = {"dtype": "int8", "scope": "per_channel", "symmetric": True, "method": "minmax"}


def mixed_config() -> dict[str, Any]:
    """int4 group 32 everywhere except the linear-attention projections, int8 per-channel."""
    return {
        "apiversion": "modelslim_v1",
        "spec": {
            "process": [
                {
                    "type": "linear_quant",
                    "qconfig": {"weight": {**W4_G32, "ext": {"group_size": 32}}},
                    "exclude": ["*linear_attn*"],
                },
                {
                    "type": "linear_quant",
                    "qconfig": {"weight": W8_CH},
                    "include": ["*linear_attn*"],
                },
            ],
            "save": [{"type": "gptq_saver", "part_file_size": 0}],
        },
    }


def stored_schemes(export: Path) -> dict[str, tuple[int, int]]:
    """``(bits, group_size)`` of each quantized module, from its stored tensors alone."""
    schemes = {}
    with safe_open(str(export / "model.safetensors"), framework="pt") as handle:
        for name in handle.keys():
            if name.endswith(".qweight"):
                module = name.removesuffix(".qweight")
                rows, _ = handle.get_slice(name).get_shape()
                in_features = handle.get_slice(f"{module}.g_idx").get_shape()[0]
                bits = rows * 32 // in_features
                groups = handle.get_slice(f"{module}.scales").get_shape()[0]
                schemes[module] = (bits, -1 if groups == 1 else in_features // groups)
    return schemes


def test_vllm_matches_qwen3_5_fused_projections_as_stored(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    export = tmp_path / "gptq"
    msquant.quantize(tiny_model_factory("qwen3_5_text"), export, mixed_config(), progress=False)
    qconfig = json.loads((export / "config.json").read_text(encoding="utf-8"))[
        "quantization_config"
    ]
    vllm_engine.load_vllm()
    from vllm.model_executor.layers.quantization.auto_gptq import AutoGPTQConfig
    from vllm.model_executor.layers.quantization.utils.gptq_utils import (
        get_dynamic_override,
        is_layer_gptq_quantized,
        override_config,
    )

    config = AutoGPTQConfig.from_config(qconfig)
    config.packed_modules_mapping = QWEN3_5_PACKED
    config.maybe_update_config(str(export))
    stored = stored_schemes(export)
    assert stored["model.layers.0.linear_attn.in_proj_qkv"] == (8, -1)
    assert stored["model.layers.1.self_attn.q_proj"] == (4, 32)
    for prefix in VLLM_MODULES:
        parent, _, leaf = prefix.rpartition(".")
        shards = [f"{parent}.{s}" for s in QWEN3_5_PACKED.get(leaf, [leaf])]
        (want,) = {stored.get(shard) for shard in shards}  # shards stored alike
        quantized = is_layer_gptq_quantized(
            prefix, config.modules_in_block_to_quantize, config.packed_modules_mapping
        )
        if get_dynamic_override(config, layer_name=prefix) is False or not quantized:
            assert want is None, prefix
            continue
        resolved = copy.deepcopy(config)
        override_config(resolved, prefix=prefix)
        assert (resolved.weight_bits, resolved.group_size) == want, prefix
