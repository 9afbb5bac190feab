"""``quarot`` on MoE MLPs, DeepSeek's multi-head latent attention and Qwen3-Next: the rotated model
computes what the original did (float64 reference) in memory and in full runs (streamed and not),
every weight on the residual stream is rotated (routers, every expert, shared experts and their
gate, dense layers of MoE models), and the exports load in transformers."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from rotation_helpers import (
    TOKENS,
    load,
    read_back,
    rotate_in_memory,
    rotated_run_logits,
    save_with_random_norms,
)
from torch import nn
from transformers import AutoModelForCausalLM

import msquant
from msquant import QuantizationError
from msquant.plugin import adapter_for
from msquant.processors.quarot.processor import check_rms_norm

#: family id -> (tiny_models arch, build arguments)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3_moe": ("qwen3_moe", {}),
    "qwen2_moe": ("qwen2_moe", {}),  # shared expert and its shared_expert_gate
    "deepseek_v3": ("deepseek_v3", {}),  # MLA with q_lora_rank: q_a_proj
    "deepseek_v3_no_q_lora": ("deepseek_v3", {"q_lora_rank": None}),  # MLA reading with q_proj
    # dense layers only: no router computing in float32, so MLA's rotations are checked to 1e-10
    "deepseek_v3_dense": ("deepseek_v3", {"first_k_dense_replace": 2}),
    "glm4_moe": ("glm4_moe", {}),
    "minimax_m2": ("minimax_m2", {"intermediate_size": 32}),
    "qwen3_next": ("qwen3_next", {}),  # Gated DeltaNet + gated attention, 1 + weight norms
    "qwen3_5_text": ("qwen3_5_text", {}),  # Gated DeltaNet (four in_proj), 1 + weight norms
    # GLM-5: MLA with the DSA indexer, whose wk and weights_proj read the normed stream
    "glm_moe_dsa": ("glm_moe_dsa", {}),
}

#: DeepSeek-V3's and GLM-4-MoE's routers compute their logits in float32 whatever the model's
#: dtype (transformers casts them), so their float64 logits carry float32 rounding of the routing
#: weights (about 1e-7); everything else is float64 throughout.
FLOAT32_ROUTERS = {"deepseek_v3", "deepseek_v3_no_q_lora", "glm4_moe", "glm_moe_dsa"}


@pytest.fixture(scope="module")
def family_model(
    tiny_model_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], Path]:
    """The family's tiny model with random norm scales, saved (float32)."""
    cache: dict[str, Path] = {}

    def build(family: str) -> Path:
        if family not in cache:
            arch, params = FAMILIES[family]
            source = tiny_model_factory(arch, **params)
            cache[family] = save_with_random_norms(source, tmp_path_factory.mktemp(family))
        return cache[family]

    return build


def _parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter of the model, copied."""
    return {name: parameter.detach().clone() for name, parameter in model.named_parameters()}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_rotated_model_computes_the_same_logits_float64(
    family: str, family_model: Callable[[str], Path], tmp_path: Path
) -> None:
    model = load(family_model(family), torch.float64)
    with torch.no_grad():
        reference = model(TOKENS).logits
    processor, _ = rotate_in_memory(model, tmp_path)
    with torch.no_grad():
        rotated = model(TOKENS).logits
    tolerance = 1e-6 if family in FLOAT32_ROUTERS else 1e-10
    error = float((rotated - reference).abs().max())
    assert error < tolerance, error
    # the stream's norms now have unit gain: ones, or zeros for norms scaling by 1 + weight
    offset = adapter_for(model).norm_scale_offset or 0.0
    layout = processor.layout
    for name in [layout.final_norm] + [e.norm for layer in layout.layers for e in layer.norms]:
        weight = model.get_submodule(name).weight
        assert torch.equal(weight, torch.full_like(weight, 1.0 - offset)), name


def _reader_and_writer_names(family: str, layer: int) -> tuple[set[str], set[str]]:
    """What must be rotated in decoder layer ``layer`` of the family's tiny model (2 layers)."""
    prefix = f"model.layers.{layer}."
    mla = ({"self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa"}, {"self_attn.o_proj"})
    attention = {
        "deepseek_v3_dense": mla,
        "deepseek_v3": (
            {"self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa"},
            {"self_attn.o_proj"},
        ),
        "deepseek_v3_no_q_lora": (
            {"self_attn.q_proj", "self_attn.kv_a_proj_with_mqa"},
            {"self_attn.o_proj"},
        ),
        "glm_moe_dsa": (
            {
                "self_attn.q_a_proj",
                "self_attn.kv_a_proj_with_mqa",
                "self_attn.indexer.wk",
                "self_attn.indexer.weights_proj",
            },
            {"self_attn.o_proj"},
        ),
    }.get(
        family, ({"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"}, {"self_attn.o_proj"})
    )
    if family in ("qwen3_next", "qwen3_5_text") and layer == 0:
        inputs = {"qwen3_next": ("in_proj_qkvz", "in_proj_ba")}.get(
            family, ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
        )
        attention = ({f"linear_attn.{n}" for n in inputs}, {"linear_attn.out_proj"})
    dense = family in ("qwen3_5_text", "deepseek_v3_dense", "glm_moe_dsa") or (
        family in ("deepseek_v3", "deepseek_v3_no_q_lora", "glm4_moe") and layer == 0
    )
    if dense:
        mlp = ({"mlp.gate_proj", "mlp.up_proj"}, {"mlp.down_proj"})
    else:
        experts = 4 if family == "minimax_m2" else 8
        readers = {f"mlp.experts.{e}.{p}" for e in range(experts) for p in ("gate_proj", "up_proj")}
        writers = {f"mlp.experts.{e}.down_proj" for e in range(experts)}
        readers.add("mlp.gate")
        shared = {"qwen2_moe": "shared_expert", "qwen3_next": "shared_expert"}.get(family)
        if family in ("deepseek_v3", "deepseek_v3_no_q_lora", "glm4_moe"):
            shared = "shared_experts"
        if shared is not None:
            readers |= {f"mlp.{shared}.gate_proj", f"mlp.{shared}.up_proj"}
            writers.add(f"mlp.{shared}.down_proj")
        if family in ("qwen2_moe", "qwen3_next"):
            readers.add("mlp.shared_expert_gate")
        mlp = (readers, writers)
    return (
        {prefix + n for n in attention[0] | mlp[0]},
        {prefix + n for n in attention[1] | mlp[1]},
    )


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_reader_and_writer_of_the_stream_is_rotated(
    family: str, family_model: Callable[[str], Path], tmp_path: Path
) -> None:
    model = load(family_model(family), torch.float64)
    before = _parameters(model)
    processor, _ = rotate_in_memory(model, tmp_path)
    for index, found in enumerate(processor.layout.layers):
        readers, writers = _reader_and_writer_names(family, index)
        assert {n for e in found.norms for n in e.readers} == readers
        assert set(found.writers) == writers
        for name in readers | writers:  # rotated: the weight changed
            weight = model.get_submodule(name).weight
            assert not torch.allclose(weight, before[name + ".weight"]), name
    # the weights inside the attention after its projections are left alone (MLA's q_b_proj and
    # the key rows of kv_b_proj, the per-head norms of Qwen3 / Qwen3-Next / MiniMax-M2); MLA's
    # value rows of kv_b_proj are rotated per head (with o_proj's columns)
    after = dict(model.named_parameters())
    for name, parameter in after.items():
        inside = ("q_b_proj", "q_norm", "k_norm", "a_layernorm", "indexer.wq_b")
        if any(part in name for part in inside):
            assert torch.equal(parameter, before[name]), name
    if family.startswith("deepseek_v3"):
        config = model.config
        width = config.qk_nope_head_dim + config.v_head_dim
        for layer in range(2):
            full = f"model.layers.{layer}.self_attn.kv_b_proj.weight"
            rows, was = after[full].view(4, width, -1), before[full].view(4, width, -1)
            nope = config.qk_nope_head_dim
            assert torch.equal(rows[:, :nope], was[:, :nope])
            assert not torch.allclose(rows[:, nope:], was[:, nope:])


def test_per_head_rotation_is_kept_only_where_it_is_exact(
    family_model: Callable[[str], Path], tmp_path: Path
) -> None:
    # plain q/k/v attention rotates v/o per head, MLA the value rows of kv_b_proj (after each
    # head's 8 k_nope rows) and o_proj; Qwen3-Next's gated attention multiplies the attention
    # output by a gate channel by channel, and its linear attention has no heads to rotate
    expected = {  # per layer: (value, head width, rows skipped per head)
        "qwen3_moe": [("v_proj", 16, 0)] * 2,
        "minimax_m2": [("v_proj", 16, 0)] * 2,
        "deepseek_v3": [("kv_b_proj", 16, 8)] * 2,
        "qwen3_next": [None, None],
    }
    for family, per_layer in expected.items():
        model = load(family_model(family))
        processor, _ = rotate_in_memory(model, tmp_path)
        found = [
            (layer.value_output[0][0].rpartition(".")[2], layer.head_width, layer.value_skip)
            if layer.value_output
            else None
            for layer in processor.layout.layers
        ]
        assert found == per_layer, family


def test_one_plus_weight_norm_is_measured_and_a_contradicting_declaration_refused(
    family_model: Callable[[str], Path],
) -> None:
    """A norm's offset is measured (1 for Qwen3-Next's, whatever the adapter says); an adapter
    declaring another offset than the norm computes is refused, naming the fix."""
    model = load(family_model("qwen3_next"))
    norm = model.model.layers[0].input_layernorm
    assert check_rms_norm(norm, "n", offset=1.0) == 1.0  # what the Qwen3-Next adapter declares
    assert check_rms_norm(norm, "n") == 1.0  # not declared: measured
    with pytest.raises(
        QuantizationError,
        match=r"n \(Qwen3NextRMSNorm\) computes x / rms\(x\) \* \(1 \+ weight\), but the model "
        r"adapter declares norms scaling by 0 \+ weight \(norm_scale_offset\): fix the adapter",
    ):
        check_rms_norm(norm, "n", offset=0.0)


class _ExtraReader(nn.Module):
    """A MoE block child the rotation does not know (a linear reading the stream)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, 4, bias=False)


def test_an_unknown_module_in_a_moe_block_is_refused_before_weights_load(
    family_model: Callable[[str], Path],
) -> None:
    model = load(family_model("qwen3_moe"))
    adapter = adapter_for(model)
    adapter.unfuse_experts(model)
    model.model.layers[1].mlp.extra = _ExtraReader(64)
    layout, problems = adapter.rotation_layout(model, adapter.decoder_layers(model))
    assert layout is None
    assert problems == [
        "model.layers.1.mlp holds modules the rotation does not know (extra (_ExtraReader)): a "
        "MoE block may hold routers (a linear or a 2-D weight), experts and shared experts with "
        "gate_proj / up_proj / down_proj"
    ]


def test_an_unknown_reader_of_the_stream_is_refused(family_model: Callable[[str], Path]) -> None:
    model = load(family_model("minimax_m2"))
    adapter = adapter_for(model)
    adapter.unfuse_experts(model)
    model.model.layers[0].self_attn.gate_proj = nn.Linear(64, 64, bias=False)
    layout, problems = adapter.rotation_layout(model, adapter.decoder_layers(model))
    assert layout is None
    assert len(problems) == 1
    assert problems[0].startswith(
        "model.layers.0.self_attn.gate_proj (Linear) reads the residual stream's width 64 but is "
        "not a reader the rotation knows for this layer (q/k/v attention, MoE)"
    )


# -- full runs and exports -------------------------------------------------------------------


def _config(*process: dict[str, Any], save: str = "ascendv1_saver") -> dict[str, Any]:
    return {
        "apiversion": "modelslim_v1",
        "spec": {"process": list(process), "save": [{"type": save}]},
    }


RUN_FAMILIES = ["qwen3_moe", "deepseek_v3", "glm4_moe", "minimax_m2", "qwen3_next"]


@pytest.mark.parametrize("runner", ["layer_wise", "model_wise"])
@pytest.mark.parametrize("family", RUN_FAMILIES)
def test_full_run_float_export_computes_the_same_logits(
    family: str, runner: str, family_model: Callable[[str], Path], tmp_path: Path
) -> None:
    path = family_model(family)
    out = tmp_path / "out"
    got, reference = rotated_run_logits(path, out, runner)
    assert torch.allclose(got, reference, rtol=0, atol=2e-5), (got - reference).abs().max()
    marker = json.loads((out / "msquant_export.json").read_text(encoding="utf-8"))
    assert marker["weights_transformed_by"] == ["quarot"]


W8A8_DYNAMIC = {
    "type": "linear_quant",
    "qconfig": {
        "act": {"scope": "per_token", "dtype": "int8", "symmetric": True, "method": "minmax"},
        "weight": {"scope": "per_channel", "dtype": "int8", "symmetric": True, "method": "minmax"},
    },
}


@pytest.mark.parametrize("family", RUN_FAMILIES)
def test_quantized_export_verifies_and_loads_in_transformers(
    family: str, family_model: Callable[[str], Path], tmp_path: Path, run_cli: Callable[..., Any]
) -> None:
    path = family_model(family)
    out = tmp_path / "w8a8"
    msquant.quantize(str(path), str(out), _config({"type": "quarot"}, W8A8_DYNAMIC), progress=False)
    description = json.loads((out / "quant_model_description.json").read_text(encoding="utf-8"))
    assert description["model_quant_type"] == "W8A8_DYNAMIC"
    assert run_cli("verify", out).code == 0
    against_original = run_cli("verify", out, "--model_path", path)
    assert against_original.code == 0, against_original.out + against_original.err
    back = read_back(out)
    with torch.no_grad():
        reference = load(path)(TOKENS).logits
        got = back(TOKENS).logits
    assert (got - reference).abs().max() < 0.05 * reference.abs().max()


@pytest.mark.parametrize("family", RUN_FAMILIES)
def test_compressed_tensors_export_loads_in_transformers(
    family: str, family_model: Callable[[str], Path], tmp_path: Path
) -> None:
    path = family_model(family)
    out = tmp_path / "ct"
    weights = {"scope": "per_channel", "dtype": "int8", "symmetric": True, "method": "minmax"}
    w8a16 = {"type": "linear_quant", "qconfig": {"weight": weights}}
    msquant.quantize(
        str(path), str(out), _config({"type": "quarot"}, w8a16, save="compressed_tensors"),
        progress=False,
    )  # fmt: skip
    loaded = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    with torch.no_grad():
        reference = load(path)(TOKENS).logits
        served = loaded(TOKENS).logits.float()
    assert (served - reference).abs().max() < 0.05 * reference.abs().max()
