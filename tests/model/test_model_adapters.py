"""Model adapters keyed by ``config.model_type``: the registry's rules, the default adapter for
every architecture without one, and the built-in Qwen3.5 adapter (vLLM's fused Gated DeltaNet
projections ``in_proj_qkvz`` and ``in_proj_ba``, which the generic heuristics do not know)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from importlib.metadata import EntryPoint
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors.torch import save_file
from tiny_models import ARCHS
from transformers import AutoConfig

import msquant
import msquant.plugin
import msquant.plugin.model
import msquant.plugin.planning
from msquant import RegistryError
from msquant.config.processors import build_processors
from msquant.config.resolve import resolve_config
from msquant.load.model_folder import build_meta_model
from msquant.plugin import ModelAdapter
from msquant.plugin.model import FusedGroup, ModelAdapterRegistry
from msquant.processors.adapters.qwen3_5 import Qwen35Adapter

QWEN3_5_TYPES = ["qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"]
#: Architectures the rest of the suite covers: none may get an adapter of its own by accident,
#: so their plans and exports stay those of the default heuristics.
COVERED = ["llama", "qwen2", "qwen3", "mistral", "qwen2_moe", "qwen3_moe", "mixtral", "deepseek_v3"]
INT8_CH = {"dtype": "int8", "scope": "per_channel", "symmetric": True, "method": "minmax"}


def meta_model(arch: str) -> torch.nn.Module:
    """A weightless tiny model of ``arch`` (the shapes of tests/tiny_models.py)."""
    params = dict(ARCHS[arch])
    config = AutoConfig.for_model(
        params.pop("model_type"),
        vocab_size=384,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        **params,
    )
    return build_meta_model(config)


def config(**entry: Any) -> dict[str, Any]:
    process = {"type": "linear_quant", "qconfig": {"weight": INT8_CH}, **entry}
    return {
        "apiversion": "modelslim_v1",
        "spec": {"process": [process], "save": [{"type": "gptq_saver"}]},
    }


@pytest.fixture(scope="module")
def weightless_qwen3_5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen3.5 language model's config and a dummy weights file (plans read no weight)."""
    folder = tmp_path_factory.mktemp("weightless_qwen3_5")
    meta = meta_model("qwen3_5_text")
    (folder / "config.json").write_text(meta.config.to_json_string(), encoding="utf-8")
    save_file({"unrelated": torch.zeros(1)}, str(folder / "model.safetensors"))
    return folder


# -- the registry ---------------------------------------------------------------------------------


def test_a_model_type_without_adapter_gets_the_default_one() -> None:
    registry = ModelAdapterRegistry([("qwen3_5_text", Qwen35Adapter)])
    assert type(registry.get("qwen3_5_text")) is Qwen35Adapter
    assert type(registry.get("llama")) is ModelAdapter
    assert type(registry.get(None)) is ModelAdapter
    assert registry.model_types() == ["qwen3_5_text"] and "llama" not in registry


def test_the_installed_entry_points_register_qwen3_5_and_nothing_the_suite_covers() -> None:
    registry = msquant.plugin.model.default_adapter_registry()
    for model_type in QWEN3_5_TYPES:
        assert type(registry.get(model_type)) is Qwen35Adapter
    for arch in COVERED:
        model_type = ARCHS[arch]["model_type"]
        assert model_type not in registry, f"{model_type} has an adapter: its plans would change"
        assert type(msquant.plugin.adapter_for(meta_model(arch))) is ModelAdapter


def test_a_model_type_claimed_by_two_adapters_is_refused() -> None:
    class Other(ModelAdapter):
        pass

    registry = ModelAdapterRegistry([("qwen3_5", Qwen35Adapter)])
    registry.register("qwen3_5", Qwen35Adapter)  # the same class twice is harmless
    with pytest.raises(
        RegistryError, match="model adapter for model type 'qwen3_5' is registered twice: by "
    ) as info:
        registry.register("qwen3_5", Other)
    assert "qwen3_5.Qwen35Adapter" in str(info.value) and "Other" in str(info.value)
    with pytest.raises(RegistryError, match="must be a msquant.plugin.ModelAdapter subclass"):
        registry.register("llama", dict)  # type: ignore[arg-type]
    with pytest.raises(RegistryError, match="non-empty model_type"):
        registry.register("", Other)


def test_entry_points_are_loaded_and_broken_plugins_reported(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    group = msquant.plugin.MODEL_ADAPTER_GROUP
    points = [EntryPoint("mine", "msquant.processors.adapters.qwen3_5:Qwen35Adapter", group)]
    monkeypatch.setattr("msquant.registry_base.entry_points", lambda group: points)
    assert ModelAdapterRegistry().load_entry_points().model_types() == ["mine"]
    points[:] = [EntryPoint("broken", "no_such_module_xyz:Adapter", group)]
    registry = ModelAdapterRegistry().load_entry_points()
    assert type(registry.get("llama")) is ModelAdapter  # other model types are unaffected
    with pytest.raises(RegistryError, match="model adapter plugin 'broken' .* failed to import"):
        registry.get("broken")  # not the default adapter: it would misread such a model
    points[:] = [EntryPoint("wrong", "msquant.errors:RegistryError", group)]
    with pytest.raises(RegistryError, match="wrong = msquant.errors:RegistryError .* is not a"):
        ModelAdapterRegistry().load_entry_points().get("wrong")


# -- the default adapter --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("arch", "fused"),
    [
        ("llama", "model.layers.0.self_attn.qkv_proj"),
        ("qwen3_moe", "model.layers.0.self_attn.qkv_proj"),
        ("deepseek_v3", "model.layers.0.self_attn.fused_qkv_a_proj"),
    ],
)
def test_the_default_adapter_answers_with_the_generic_heuristics(arch: str, fused: str) -> None:
    model = meta_model(arch)
    adapter = msquant.plugin.adapter_for(model)
    layers = adapter.decoder_layers(model)
    assert [layer.name for layer in layers] == ["model.layers.0", "model.layers.1"]
    assert adapter.output_head(model) == ("lm_head", model.lm_head)
    assert adapter.final_norm(model, layers) is model.model.norm
    names = [name for layer in layers for name, _ in layer.named_linears()]
    assert fused in {group.fused_name for group in adapter.fused_groups(names)}
    assert adapter.fused_groups(names) == msquant.plugin.model.fused_groups(names)
    assert adapter.engine_names(names) == msquant.plugin.model.engine_names(names)


# -- Qwen3.5 ----------------------------------------------------------------------------------------


def linear_names(model: torch.nn.Module) -> list[str]:
    layers = msquant.plugin.adapter_for(model).decoder_layers(model)
    return [name for layer in layers for name, _ in layer.named_linears()]


def test_qwen3_5_fused_projections_are_vllms() -> None:
    """vLLM's Qwen3.5 ``packed_modules_mapping``: ``in_proj_qkvz = [in_proj_qkv, in_proj_z]``,
    ``in_proj_ba = [in_proj_b, in_proj_a]``, shards in that order; the default heuristics see
    only the full-attention layer's qkv_proj and the MLPs' gate_up_proj."""
    model = meta_model("qwen3_5_text")
    adapter = msquant.plugin.adapter_for(model)
    assert type(adapter) is Qwen35Adapter
    names = linear_names(model)
    found = adapter.fused_groups(names)
    attn = "model.layers.0.linear_attn."
    assert FusedGroup(attn + "in_proj_qkvz", (attn + "in_proj_qkv", attn + "in_proj_z")) in found
    assert FusedGroup(attn + "in_proj_ba", (attn + "in_proj_b", attn + "in_proj_a")) in found
    before = {group.fused_name for group in ModelAdapter().fused_groups(names)}
    after = {group.fused_name for group in found}
    assert after - before == {attn + "in_proj_qkvz", attn + "in_proj_ba"}
    assert before == {
        "model.layers.0.mlp.gate_up_proj",
        "model.layers.1.mlp.gate_up_proj",
        "model.layers.1.self_attn.qkv_proj",
    }
    assert adapter.engine_names(names)[attn + "in_proj_z"][0].fused_name == attn + "in_proj_qkvz"


def test_qwen3_5_plan_refuses_a_fused_projection_half_quantized(weightless_qwen3_5: Path) -> None:
    """Excluding ``in_proj_z`` and ``in_proj_a`` leaves vLLM's fused matrices half quantized (vLLM:
    "Detected some but not all shards ... are quantized"); the default heuristics let it pass."""
    cfg = config(exclude=["*in_proj_z", "*in_proj_a"])
    result = msquant.plugin.planning.build_plan(weightless_qwen3_5, cfg)
    assert len(result.errors) == 2
    qkvz, ba = result.errors
    assert qkvz.startswith(
        "model.layers.0.linear_attn.in_proj_qkvz is loaded as one fused matrix by vLLM"
    )
    assert "model.layers.0.linear_attn.in_proj_qkv: int8 per-channel sym by spec.process[0]" in qkvz
    assert (
        "model.layers.0.linear_attn.in_proj_z: not quantized (spec.process[0] exclude *in_proj_z)"
        in qkvz
    )
    assert ba.startswith("model.layers.0.linear_attn.in_proj_ba is loaded as one fused matrix")
    # before this adapter: the same plan under the generic heuristics has no error
    resolved = resolve_config(cfg, msquant.plugin.default_registry())
    processors = build_processors(resolved.config, msquant.plugin.default_registry())
    model = build_meta_model(AutoConfig.from_pretrained(weightless_qwen3_5))
    layers = ModelAdapter().decoder_layers(model)
    assert (
        msquant.plugin.planning.analyse_plan(
            processors, model, layers, adapter=ModelAdapter()
        ).errors
        == []
    )


def test_qwen3_5_rules_splitting_a_fused_projection_inside_one_entry_are_refused(
    weightless_qwen3_5: Path,
) -> None:
    """``-:.*in_proj_qkv`` skips only ``in_proj_qkv`` in msquant (vLLM's ``re.match`` would also
    match the fused ``in_proj_qkvz``): the split is refused and the rule warned about, although
    one entry selects both shards (the processors check only the generic table)."""
    cfg = config(dynamic={"-:.*in_proj_qkv": {}})
    result = msquant.plugin.planning.build_plan(weightless_qwen3_5, cfg)
    assert len(result.errors) == 1
    assert result.errors[0].startswith("model.layers.0.linear_attn.in_proj_qkvz is loaded as one")
    assert (
        'model.layers.0.linear_attn.in_proj_qkv: not quantized by spec.process[0].dynamic["-:.*'
        in result.errors[0]
    )
    mismatch = [w for w in result.warnings if "in_proj_qkvz" in w]
    assert len(mismatch) == 1
    assert "make it match all of in_proj_qkv, in_proj_z, in_proj_qkvz or none" in mismatch[0]
    # the generic heuristics: neither the error nor the warning
    resolved = resolve_config(cfg, msquant.plugin.default_registry())
    processors = build_processors(resolved.config, msquant.plugin.default_registry())
    model = build_meta_model(AutoConfig.from_pretrained(weightless_qwen3_5))
    layers = ModelAdapter().decoder_layers(model)
    before = msquant.plugin.planning.analyse_plan(processors, model, layers, adapter=ModelAdapter())
    assert before.errors == [] and not [w for w in before.warnings if "in_proj" in w]


def test_cli_refuses_the_half_quantized_qwen3_5_before_loading(
    tiny_model_factory: Callable[..., Path], tmp_path: Path, run_cli: Callable[..., Any]
) -> None:
    model = tiny_model_factory("qwen3_5_text")
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config(exclude=["*in_proj_z"])), encoding="utf-8")
    save = tmp_path / "out"
    result = run_cli("quant", "--model_path", model, "--save_path", save, "--config_path", path)
    assert result.code == 2
    assert "the config cannot be applied to this model (1 problem)" in result.err
    assert "model.layers.0.linear_attn.in_proj_qkvz is loaded as one fused matrix" in result.err
    assert not save.exists()


def test_qwen3_5_quantizes_with_its_fused_projections_alike(
    tiny_model_factory: Callable[..., Path], tmp_path: Path, run_cli: Callable[..., Any]
) -> None:
    """A uniform W8A16 run: every Gated DeltaNet projection quantized, read back by verify."""
    model = tiny_model_factory("qwen3_5_text")
    save = tmp_path / "w8a16"
    result = run_cli("quant", "--model_path", model, "--save_path", save, "--quant_type", "w8a16")
    assert result.code == 0, result.err
    description = json.loads((save / "quant_model_description.json").read_text(encoding="utf-8"))
    attn = "model.layers.0.linear_attn."
    for proj in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"):
        assert description[f"{attn}{proj}.weight"] == "W8A16"
    shutil.rmtree(save)
