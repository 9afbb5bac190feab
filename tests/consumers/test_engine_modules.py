"""The always-available part of the consumer checks (default suite, no download, seconds).

The engine module lists (fused ``qkv_proj`` / ``gate_up_proj`` / ``fused_qkv_a_proj``, experts,
routers, head) cover exactly the checkpoint's linear layers for every consumer architecture,
with the right widths: the opt-in suite asks the engines about these modules, so a template that
misses or invents one would hide a problem there.

What transformers + compressed-tensors (test dependencies) load of the exports is checked in the
default suite by ``tests/processors/test_compressed_tensors_saver.py`` and ``tests/processors/test_moe_quant.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from architectures import Engine, engine_modules
from consumer_models import CONSUMER_ARCHS, NEEDS_MOE_TRANSFORMERS, build_consumer_model
from safetensors import safe_open


@pytest.fixture(scope="module")
def consumer_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    cache: dict[str, Path] = {}

    def build(arch: str) -> Path:
        if arch not in cache:
            cache[arch] = build_consumer_model(tmp_path_factory.mktemp(arch), arch)
        return cache[arch]

    return build


def _weights(folder: Path) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {}
    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118
                shapes[name] = tuple(handle.get_slice(name).get_shape())
    return shapes


@NEEDS_MOE_TRANSFORMERS
@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize("arch", CONSUMER_ARCHS)
def test_engine_modules_cover_the_checkpoint(
    arch: str, engine: Engine, consumer_model: Callable[[str], Path]
) -> None:
    folder = consumer_model(arch)
    shapes = _weights(folder)
    linear = {name[: -len(".weight")] for name, shape in shapes.items()
              if name.endswith(".weight") and len(shape) == 2 and "embed_tokens" not in name}  # fmt: skip
    modules = engine_modules(folder, engine)
    read = [shard for module in modules for shard in module.shards]
    assert len(read) == len(set(read))
    assert set(read) == linear
    for module in modules:
        if module.kind == "experts":
            for expert in range(module.num_experts):
                gate, up, down = (
                    shapes[f"{module.expert_shard(expert, r)}.weight"] for r in range(3)
                )
                assert gate == up == (module.output_sizes[0], module.input_size)
                assert down == (module.input_size, module.output_sizes[0])
        else:
            for shard, width in zip(module.shards, module.output_sizes, strict=True):
                assert shapes[f"{shard}.weight"] == (width, module.input_size), shard
    fused = {m.leaf for m in modules if len(m.shards) > 1 and m.kind == "linear"}
    expected = {"qkv_proj", "gate_up_proj"} if arch == "llama" else None
    if expected is not None:
        assert fused == expected


@NEEDS_MOE_TRANSFORMERS
def test_engine_modules_of_tied_heads_and_routers(consumer_model: Callable[[str], Path]) -> None:
    modules = {m.prefix: m for m in engine_modules(consumer_model("qwen3_moe"), "vllm")}
    assert modules["model.layers.0.mlp.gate"].quantizable  # vLLM passes quant_config to it
    sglang = {m.prefix: m for m in engine_modules(consumer_model("qwen3_moe"), "sglang")}
    assert not sglang["model.layers.0.mlp.gate"].quantizable
    assert not {m.prefix: m for m in engine_modules(consumer_model("mixtral"), "sglang")}[
        "lm_head"
    ].quantizable  # SGLang's Mixtral builds its head without the quantization config
    deepseek = {m.prefix: m for m in engine_modules(consumer_model("deepseek_v3"), "sglang")}
    fused = deepseek["model.layers.0.self_attn.fused_qkv_a_proj_with_mqa"]
    assert fused.cls == "ReplicatedLinear" and fused.concat_dim == 0
    mixtral = {m.prefix: m for m in engine_modules(consumer_model("mixtral"))}
    experts = mixtral["model.layers.1.block_sparse_moe.experts"]
    assert experts.expert_shard(3, 0) == "model.layers.1.block_sparse_moe.experts.3.w1"
    assert experts.expert_shard(3, 2) == "model.layers.1.block_sparse_moe.experts.3.w2"
