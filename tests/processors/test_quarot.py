"""``quarot``: the rotated model computes what the original did (float64 reference), in memory and
in full runs (streamed and not), and its exports load with the right config; ``online_quarot`` and
``online: true`` are refused at validation."""

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
from safetensors.torch import load_file
from torch import nn
from transformers import AutoModelForCausalLM

import msquant
import msquant.plugin.export
from msquant import ConfigError, QuantizationError
from msquant.processors.quarot.config import QuaRotConfig
from msquant.processors.quarot.processor import check_rms_norm
from msquant.quant.rotation import random_hadamard

ARCHS = ["llama", "qwen2", "qwen3"]


@pytest.fixture(scope="module")
def norm_model_factory(
    tiny_model_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Callable[..., Path]:
    """Tiny models with random norm scales, saved (float32)."""
    cache: dict[tuple[str, bool], Path] = {}

    def build(arch: str, tied: bool = False) -> Path:
        key = (arch, tied)
        if key not in cache:
            source = tiny_model_factory(arch, tie_word_embeddings=tied)
            target = tmp_path_factory.mktemp(f"norms_{arch}_{tied}")
            cache[key] = save_with_random_norms(source, target)
        return cache[key]

    return build


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("arch", ARCHS)
def test_rotated_model_computes_the_same_logits_float64(
    arch: str, tied: bool, norm_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    path = norm_model_factory(arch, tied)
    model = load(path, torch.float64)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    with torch.no_grad():
        reference = model(TOKENS).logits
    embedding_before = model.model.embed_tokens.weight.detach().clone()
    ctx = rotate_in_memory(model, tmp_path)[1]
    with torch.no_grad():
        rotated = model(TOKENS).logits
    assert torch.allclose(rotated, reference, rtol=0, atol=1e-10), (rotated - reference).abs().max()
    # the weights did change: embedding rotated, norms folded to ones, head untied
    assert not torch.allclose(model.model.embed_tokens.weight, embedding_before)
    norms = [p for n, p in model.named_parameters() if "layernorm" in n or n == "model.norm.weight"]
    assert norms and all(torch.equal(p, torch.ones_like(p)) for p in norms)
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert model.config.tie_word_embeddings is False
    assert ctx.config_updates == ({"tie_word_embeddings": False} if tied else {})
    exported = ctx.optional_tensors["quarot"]["global_rotation"]
    assert exported.dtype == torch.float32 and exported.shape == (64, 64)


def test_rotation_flattens_the_residual_stream(
    norm_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    # what the rotation is for: the residual stream's largest channel relative to its rms drops
    model = load(norm_model_factory("llama"), torch.float64)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 3] *= 30.0  # an outlier channel
        before = model(TOKENS, output_hidden_states=True).hidden_states[1]
        rotate_in_memory(model, tmp_path)
        after = model(TOKENS, output_hidden_states=True).hidden_states[1]

    def peak_to_rms(x: torch.Tensor) -> float:
        return float((x.abs().amax(-1) / x.pow(2).mean(-1).sqrt()).mean())

    assert peak_to_rms(after) < peak_to_rms(before) / 2


def test_block_size_rotation_computes_the_same_logits(
    norm_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    model = load(norm_model_factory("qwen3"), torch.float64)
    with torch.no_grad():
        reference = model(TOKENS).logits
        ctx = rotate_in_memory(model, tmp_path, block_size=8, export_extra_info=False)[1]
        rotated = model(TOKENS).logits
    assert torch.allclose(rotated, reference, rtol=0, atol=1e-10)
    assert ctx.optional_tensors == {}


def test_model_wise_rotation_matches_msmodelslim_arithmetic(
    norm_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    # float32 weights are rotated in float32 (msModelSlim's arithmetic): q_proj = (W * g) @ R

    model = load(norm_model_factory("llama"))
    weight = model.model.layers[0].self_attn.q_proj.weight.detach().clone()
    norm = model.model.layers[0].input_layernorm.weight.detach().clone()
    rotate_in_memory(model, tmp_path)
    expected = torch.matmul(weight * norm, random_hadamard(64))
    assert torch.equal(model.model.layers[0].self_attn.q_proj.weight, expected)


class _LayerNorm(nn.Module):
    """A mean-subtracting norm: folding it and rotating would change the outputs."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x - x.mean(-1, keepdim=True)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


def test_a_norm_that_is_not_rmsnorm_is_refused(
    norm_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    model = load(norm_model_factory("llama"))
    assert check_rms_norm(model.model.norm, "model.norm") == 0.0  # the real one passes
    with pytest.raises(
        QuantizationError,
        match=r"model.norm \(_LayerNorm\) is a LayerNorm \(\(x - mean\(x\)\) / std\(x\) \* "
        r"weight\); RMSNorm is needed",
    ):
        check_rms_norm(_LayerNorm(64), "model.norm")


# -- validation ------------------------------------------------------------------------------


def _config(*process: dict[str, Any], save: str = "ascendv1_saver") -> dict[str, Any]:
    return {
        "apiversion": "modelslim_v1",
        "spec": {"process": list(process), "save": [{"type": save}]},
    }


def test_msmodelslim_fields_and_defaults_validate() -> None:
    config = msquant.validate_config(
        _config(
            {
                "type": "quarot",
                "online": False,
                "block_size": -1,
                "down_proj_online_layers": [],
                "max_tp_size": 4,
                "export_extra_info": True,
            }
        ),
        msquant.plugin.default_registry(),
    )
    entry = config.spec.process[0]
    assert isinstance(entry, QuaRotConfig)
    assert entry.model_dump() == QuaRotConfig().model_dump()


@pytest.mark.parametrize(
    ("entry", "path", "message"),
    [
        ({"type": "quarot", "online": True}, "spec.process[0].online", "online: true"),
        ({"type": "online_quarot"}, "spec.process[0].type", "online_quarot"),
        (
            {"type": "quarot", "block_size": 48},
            "spec.process[0].block_size",
            "power of two, got 48",
        ),
        ({"type": "quarot", "max_tp_size": 3}, "spec.process[0].max_tp_size", "got 3"),
        ({"type": "quarot", "bogus": 1}, "spec.process[0].bogus", ""),
    ],
)
def test_bad_entries_are_refused_with_their_path(
    entry: dict[str, Any], path: str, message: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        msquant.validate_config(_config(entry), msquant.plugin.default_registry())
    issues = {issue.path: issue.message for issue in caught.value.issues}
    assert path in issues, issues
    assert message in issues[path]


def test_online_rotation_exits_2_from_the_cli(tmp_path: Path, run_cli: Callable[..., Any]) -> None:
    config = tmp_path / "online.yaml"
    config.write_text(
        "apiversion: modelslim_v1\nspec:\n  process:\n    - type: online_quarot\n"
        "    - type: quarot\n      online: true\n",
        encoding="utf-8",
    )
    result = run_cli("validate", config)
    assert result.code == 2
    assert "vLLM-Ascend" in result.err and "online: false" in result.err
    assert "Traceback" not in result.err


def test_block_size_not_dividing_head_dim_is_refused_before_weightsload(
    norm_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    # qwen3's head_dim is 16: block 32 divides the hidden size 64 but not the heads
    config = _config({"type": "quarot", "block_size": 32})
    with pytest.raises(
        msquant.MsquantInputError, match="block_size 32 does not divide the head_dim 16"
    ):
        msquant.quantize(str(norm_model_factory("qwen3")), str(tmp_path / "out"), config)


# -- full runs and exports -------------------------------------------------------------------


@pytest.mark.parametrize("runner", ["layer_wise", "model_wise"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_full_run_float_export_computes_the_same_logits(
    runner: str, tied: bool, norm_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    path = norm_model_factory("qwen2", tied)
    out = tmp_path / "out"
    got, reference = rotated_run_logits(path, out, runner)
    assert torch.allclose(got, reference, rtol=0, atol=2e-5), (got - reference).abs().max()
    exported = json.loads((out / "config.json").read_text(encoding="utf-8"))
    assert exported.get("tie_word_embeddings", False) is False
    weights = load_file(str(out / "quant_model_weights-00001-of-00001.safetensors"))
    assert "lm_head.weight" in weights
    assert not torch.equal(weights["lm_head.weight"], weights["model.embed_tokens.weight"])
    assert torch.equal(weights["model.norm.weight"], torch.ones(64))
    description = json.loads((out / "quant_model_description.json").read_text(encoding="utf-8"))
    assert description["optional"] == {
        "quarot": {"rotation_map": {"global_rotation": "optional/quarot.safetensors"}}
    }
    rotation = load_file(str(out / "optional" / "quarot.safetensors"))["global_rotation"]
    assert torch.equal(rotation, random_hadamard(64))
    assert description["lm_head.weight"] == "FLOAT"


W8A8_DYNAMIC = {
    "type": "linear_quant",
    "qconfig": {
        "act": {"scope": "per_token", "dtype": "int8", "symmetric": True, "method": "minmax"},
        "weight": {"scope": "per_channel", "dtype": "int8", "symmetric": True, "method": "minmax"},
    },
}
W8A16 = {
    "type": "linear_quant",
    "qconfig": {
        "weight": {"scope": "per_channel", "dtype": "int8", "symmetric": True, "method": "minmax"}
    },
}


def test_quantized_ascend_export_verifies_and_evaluates(
    norm_model_factory: Callable[..., Path], tmp_path: Path, run_cli: Callable[..., Any]
) -> None:
    path = norm_model_factory("llama", True)
    out = tmp_path / "w8a8"
    msquant.quantize(str(path), str(out), _config({"type": "quarot"}, W8A8_DYNAMIC), progress=False)
    description = json.loads((out / "quant_model_description.json").read_text(encoding="utf-8"))
    assert description["model_quant_type"] == "W8A8_DYNAMIC"
    assert description["model.layers.0.self_attn.q_proj.weight"] == "W8A8_DYNAMIC"
    assert description["lm_head.weight"] == "FLOAT"
    assert run_cli("verify", out).code == 0
    # against the original model: the rotated weights differ by design, the marker says why,
    # and the logits on a few tokens are compared instead of the tensors
    marker = json.loads((out / "msquant_export.json").read_text(encoding="utf-8"))
    assert marker["weights_transformed_by"] == ["quarot"]
    against_original = run_cli("verify", out, "--model_path", path)
    assert against_original.code == 0, against_original.out + against_original.err
    assert "forward check (32 tokens" in against_original.out
    back = read_back(out)
    with torch.no_grad():
        reference = load(path)(TOKENS).logits
        got = back(TOKENS).logits
    # int8 weights (activations are simulated only by msquant eval): close to the float model
    assert (got - reference).abs().max() < 0.05 * reference.abs().max()


@pytest.mark.parametrize("save", ["compressed_tensors", "gptq_saver"])
def test_hf_exports_of_a_tied_model_carry_the_head_and_untie(
    save: str, norm_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    path = norm_model_factory("qwen3", True)
    out = tmp_path / save
    msquant.quantize(
        str(path), str(out), _config({"type": "quarot"}, W8A16, save=save), progress=False
    )
    exported = json.loads((out / "config.json").read_text(encoding="utf-8"))
    assert exported["tie_word_embeddings"] is False
    back = read_back(out)
    assert back.lm_head.weight is not back.model.embed_tokens.weight
    with torch.no_grad():
        reference = load(path)(TOKENS).logits
        got = back(TOKENS).logits
    assert (got - reference).abs().max() < 0.05 * reference.abs().max()
    if save == "compressed_tensors":  # transformers itself loads it (compressed-tensors installed)
        loaded = AutoModelForCausalLM.from_pretrained(str(out))
        assert loaded.config.tie_word_embeddings is False
        assert loaded.lm_head.weight.data_ptr() != loaded.model.embed_tokens.weight.data_ptr()
        with torch.no_grad():
            served = loaded(TOKENS).logits.float()
        assert torch.allclose(served, got, atol=1e-3 * float(got.abs().max()))


def test_config_updates_reach_nested_text_configs(tmp_path: Path) -> None:
    # a multimodal config keeps tie_word_embeddings in text_config too: both are set
    model = tmp_path / "model"
    model.mkdir()
    config = {"model_type": "x", "text_config": {"tie_word_embeddings": True, "hidden_size": 8}}
    (model / "config.json").write_text(json.dumps(config), encoding="utf-8")
    out = tmp_path / "out"
    out.mkdir()
    msquant.plugin.export.copy_model_files(model, out, {"tie_word_embeddings": False})
    written = json.loads((out / "config.json").read_text(encoding="utf-8"))
    assert written["tie_word_embeddings"] is False
    assert written["text_config"] == {"tie_word_embeddings": False, "hidden_size": 8}
    msquant.plugin.export.copy_model_files(model, out)  # no updates: the config is copied as it is
    assert json.loads((out / "config.json").read_text(encoding="utf-8")) == config
