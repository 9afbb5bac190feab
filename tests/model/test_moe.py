"""MoE experts as per-expert Linears: same forward, names on disk, token counts, fallback policy.

Tiny random MoE models of four transformers architectures (hidden 64, 4-8 experts, top-2) are
saved with ``save_pretrained`` and loaded back as msquant loads models; the saved safetensors file
is the reference for the per-expert weights and their names on disk.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import NEEDS_MOE_TRANSFORMERS
from safetensors import safe_open
from torch import nn

from msquant import ModelLoadError
from msquant.load.model_folder import build_meta_model, load_causal_lm, load_model_config
from msquant.load.streaming import StreamedWeights
from msquant.model.checkpoint_names import checkpoint_names
from msquant.model.checkpoint_sources import checkpoint_sources
from msquant.model.layers import find_decoder_layers
from msquant.model.moe import (
    DEFAULT_EXPERT_TOKEN_RATIO,
    ExpertTokenCounter,
    UnfusedExperts,
    enough_expert_tokens,
    unfuse_experts,
)

ARCHS = ["qwen2_moe", "qwen3_moe", "mixtral", "deepseek_v3"]
#: Mixtral's experts are ``intermediate_size`` wide; keep them as small as the others'.
OVERRIDES: dict[str, dict[str, object]] = {"mixtral": {"intermediate_size": 32}}
TOP_K = 2
BATCH, SEQ = 2, 24


pytestmark = NEEDS_MOE_TRANSFORMERS


@pytest.fixture(params=ARCHS)
def moe_dir(request: pytest.FixtureRequest, tiny_model_factory: Callable[..., Path]) -> Path:
    arch = request.param
    return tiny_model_factory(arch, **OVERRIDES.get(arch, {}))


def _saved(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor ``save_pretrained`` wrote (one file for these tiny models)."""
    with safe_open(str(model_dir / "model.safetensors"), "pt") as handle:
        return {key: handle.get_tensor(key) for key in handle.keys()}


def _input_ids() -> torch.Tensor:
    return torch.randint(1, 384, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))


def _logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def test_unfused_forward_equals_fused(moe_dir: Path) -> None:
    model = load_causal_lm(moe_dir)
    fused_params = sum(p.numel() for p in model.parameters())
    ids = _input_ids()
    expected = _logits(model, ids)

    info = unfuse_experts(model)

    assert info and all(
        isinstance(model.get_submodule(m.name), UnfusedExperts) for m in info.modules
    )
    assert not [n for n, p in model.named_parameters() if p.ndim == 3]
    assert sum(p.numel() for p in model.parameters()) == fused_params
    torch.testing.assert_close(_logits(model, ids), expected, rtol=0, atol=1e-5)


def test_expert_linears_hold_the_saved_expert_weights(moe_dir: Path) -> None:
    """Each expert projection is an nn.Linear that the layer walk finds, holding exactly the
    tensor save_pretrained wrote for that expert under its mapped disk name."""
    model = load_causal_lm(moe_dir)
    info = unfuse_experts(model)
    names = checkpoint_names(model)
    saved = _saved(moe_dir)

    found = {name: m for layer in find_decoder_layers(model) for name, m in layer.named_linears()}
    for module in info.modules:
        assert len(module.linear_names()) == 3 * module.num_experts
        for name in module.linear_names():
            linear = found[name]
            assert type(linear) is nn.Linear and linear.bias is None
            torch.testing.assert_close(
                linear.weight.data, saved[names.tensor_name(f"{name}.weight")], rtol=0, atol=0
            )
            wide, narrow = module.hidden_size, module.intermediate_size
            shape = (wide, narrow) if name.endswith("down_proj") else (narrow, wide)
            assert tuple(linear.weight.shape) == shape


def test_checkpoint_names_equal_save_pretrained_keys(moe_dir: Path) -> None:
    model = load_causal_lm(moe_dir)
    unfuse_experts(model)
    names = checkpoint_names(model)

    mapped = sorted(names.tensor_name(key) for key in model.state_dict())

    assert mapped == sorted(_saved(moe_dir))
    assert len(set(mapped)) == len(mapped)


def test_mixtral_disk_names(tiny_model_factory: Callable[..., Path]) -> None:
    """Mixtral renames its MoE block on disk and calls the projections w1 (gate), w3 (up), w2
    (down); tensors a saver derives from a module keep the module's disk name."""
    model = load_causal_lm(tiny_model_factory("mixtral", intermediate_size=32))
    unfuse_experts(model)
    names = checkpoint_names(model)

    prefix = "model.layers.1.block_sparse_moe"
    assert names.module_name("model.layers.1.mlp.experts.3.gate_proj") == f"{prefix}.experts.3.w1"
    assert names.tensor_name("model.layers.1.mlp.experts.3.up_proj.qweight") == (
        f"{prefix}.experts.3.w3.qweight"
    )
    assert names.tensor_name("model.layers.1.mlp.experts.0.down_proj.weight_scale") == (
        f"{prefix}.experts.0.w2.weight_scale"
    )
    assert names.tensor_name("model.layers.1.mlp.gate.weight") == f"{prefix}.gate.weight"
    assert names.tensor_name("model.layers.0.self_attn.q_proj.scales") == (
        "model.layers.0.self_attn.q_proj.scales"
    )
    assert not names.is_identity
    with pytest.raises(LookupError, match="model.layers.9.mlp.experts.0.gate_proj is not a module"):
        names.module_name("model.layers.9.mlp.experts.0.gate_proj")
    with pytest.raises(LookupError, match="not a tensor of this model"):
        names.tensor_name("model.layers.9.mlp.experts.0.gate_proj.qweight")


def test_fused_parameters_have_no_single_disk_name(tiny_model_factory: Callable[..., Path]) -> None:
    """Called before unfusing, the fused 3-D parameters are reported as converted, not guessed."""
    model = load_causal_lm(tiny_model_factory("qwen3_moe"))
    names = checkpoint_names(model)
    fused = "model.layers.0.mlp.experts.gate_up_proj"
    assert fused in names.converted
    with pytest.raises(LookupError, match=f"{fused} is saved by transformers through a weight"):
        names.tensor_name(fused)
    info = unfuse_experts(model)
    assert info.expert_of("model.layers.0.mlp.experts.5.up_proj") == "model.layers.0.mlp.experts.5"
    assert info.expert_of("model.layers.0.self_attn.q_proj") is None
    assert len(info.linear_names()) == 2 * 8 * 3


def test_meta_model_filled_from_the_checkpoint_runs_like_the_fused_one(
    tiny_model_factory: Callable[..., Path],
) -> None:
    """A streamed run unfuses the weightless model, then reads each layer's tensors (expert
    Linears from the per-expert tensors on disk) only when the layer runs."""
    model_dir = tiny_model_factory("mixtral", intermediate_size=32)
    model = load_causal_lm(model_dir)
    ids = _input_ids()
    expected = _logits(model, ids)
    layers = find_decoder_layers(model)
    for layer in layers:
        StreamedWeights.release(layer.module)  # as the streamed runner holds them
    unfuse_experts(model)
    sources = checkpoint_sources(model, checkpoint_names(model), model_dir)

    assert "model.layers.1.mlp.experts.3.gate_proj.weight" in sources
    streamed = StreamedWeights(sources)
    for layer in find_decoder_layers(model):
        streamed.materialize(layer.module, layer.name)
    torch.testing.assert_close(_logits(model, ids), expected, rtol=0, atol=1e-5)


def test_checkpoint_names_of_a_dense_model_are_unchanged(tiny_llama: Path) -> None:
    model = load_causal_lm(tiny_llama)
    assert not unfuse_experts(model)
    names = checkpoint_names(model)
    assert names.is_identity
    assert names.tensor_name("model.layers.1.mlp.down_proj.qweight") == (
        "model.layers.1.mlp.down_proj.qweight"
    )


def test_token_counts_follow_the_router(moe_dir: Path) -> None:
    """Counts equal the router's choices (bincount of top_k_index), sum to tokens x top_k per
    MoE layer, and each expert's three Linears see the same tokens."""
    model = load_causal_lm(moe_dir)
    info = unfuse_experts(model)
    routed: dict[str, torch.Tensor] = {}
    hooks = []
    for module in info.modules:

        def record(_: nn.Module, args: tuple[torch.Tensor, ...], name: str = module.name) -> None:
            routed[name] = args[1]  # top_k_index [T, K]

        hooks.append(model.get_submodule(module.name).register_forward_pre_hook(record))
    with ExpertTokenCounter(model) as counter:
        _logits(model, _input_ids())
    for hook in hooks:
        hook.remove()

    per_expert = counter.per_expert()
    for module in info.modules:
        expected = torch.bincount(routed[module.name].flatten(), minlength=module.num_experts)
        counts = [per_expert[module.expert_name(e)] for e in range(module.num_experts)]
        assert counts == expected.tolist()
        assert sum(counts) == BATCH * SEQ * TOP_K
        assert sum(1 for c in counts if c) > TOP_K  # the routing really spreads the tokens
        for e in range(module.num_experts):
            expert = module.expert_name(e)
            assert {
                counter.counts[f"{expert}.{r}"] for r in ("gate_proj", "up_proj", "down_proj")
            } == {per_expert[expert]}
    # hooks are gone after the block: a second forward changes nothing
    before = dict(counter.counts)
    _logits(model, _input_ids())
    assert counter.counts == before


def test_expert_hooks_see_exactly_the_routed_tokens(
    tiny_model_factory: Callable[..., Path],
) -> None:
    model = load_causal_lm(tiny_model_factory("qwen3_moe"))
    info = unfuse_experts(model)
    name = info.modules[-1].name
    experts = model.get_submodule(name)
    assert isinstance(experts, UnfusedExperts)
    block_inputs: list[tuple[torch.Tensor, torch.Tensor]] = []
    seen: dict[int, torch.Tensor] = {}
    handles = [
        experts.register_forward_pre_hook(lambda _, a: block_inputs.append((a[0], a[1]))),
        *(
            experts[e].gate_proj.register_forward_pre_hook(
                lambda _, a, e=e: seen.__setitem__(e, a[0])
            )
            for e in range(len(experts))
        ),
    ]
    _logits(model, _input_ids())
    for handle in handles:
        handle.remove()

    ((hidden_states, top_k_index),) = block_inputs
    for e in range(len(experts)):
        tokens = (top_k_index == e).any(dim=-1).nonzero().flatten()  # in token order
        if len(tokens) == 0:
            assert e not in seen
        else:
            torch.testing.assert_close(seen[e], hidden_states[tokens], rtol=0, atol=0)


def test_experts_forward_equals_transformers_eager(tiny_model_factory: Callable[..., Path]) -> None:
    """Module level, against transformers' own eager loop: random routing including the
    ``num_experts`` value transformers uses to mask a slot (expert parallelism), and experts
    that receive nothing."""
    model = load_causal_lm(tiny_model_factory("qwen3_moe"))
    fused = copy.deepcopy(model.get_submodule("model.layers.0.mlp.experts"))
    fused.config._experts_implementation = "eager"
    unfused = UnfusedExperts.from_fused(fused)
    gen = torch.Generator().manual_seed(1)
    hidden_states = torch.randn(40, 64, generator=gen)
    top_k_index = torch.randint(0, 4, (40, TOP_K), generator=gen)  # experts 4..7 get nothing
    top_k_index[::5, 1] = fused.num_experts  # masked slots
    top_k_weights = torch.rand(40, TOP_K, generator=gen)

    with torch.no_grad():
        expected = fused(hidden_states, top_k_index, top_k_weights)
        actual = unfused(hidden_states, top_k_index, top_k_weights)

    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-6)
    assert expected.abs().min() > 0  # every token got some expert output


def test_bf16_forward_keeps_dtype(tiny_model_factory: Callable[..., Path]) -> None:
    model = load_causal_lm(
        tiny_model_factory("mixtral", intermediate_size=32, dtype=torch.bfloat16)
    )
    ids = _input_ids()
    expected = _logits(model, ids)
    unfuse_experts(model)
    for module in model.modules():
        if isinstance(module, UnfusedExperts):
            assert {p.dtype for p in module.parameters()} == {torch.bfloat16}
    actual = _logits(model, ids)
    assert actual.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(actual, expected, rtol=0.02, atol=0.02)


def test_unfuse_on_a_meta_model(tiny_model_factory: Callable[..., Path]) -> None:
    """Planning builds the model on the meta device: unfusing must not materialise weights."""
    from transformers import AutoModelForCausalLM

    config = load_model_config(tiny_model_factory("qwen2_moe"))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    info = unfuse_experts(model)
    assert [m.num_experts for m in info.modules] == [8, 8]
    # build_meta_model (planning, checks) hands out the model already split
    assert not unfuse_experts(build_meta_model(config))
    layer = find_decoder_layers(model)[0]
    linears = dict(layer.named_linears())
    weight = linears["model.layers.0.mlp.experts.7.down_proj"].weight
    assert weight.device.type == "meta" and tuple(weight.shape) == (64, 32)
    assert "model.layers.0.mlp.shared_expert_gate" in linears  # already a Linear upstream


def test_unknown_layout_is_refused_and_nothing_changes() -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "gpt_oss", vocab_size=384, hidden_size=64, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2,
    )  # fmt: skip
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(ModelLoadError) as err:
        unfuse_experts(model)
    message = str(err.value)
    assert "model.layers.0.mlp.experts (GptOssExperts)" in message
    assert "gate_up_proj_bias" in message
    assert type(model.get_submodule("model.layers.0.mlp.experts")).__name__ == "GptOssExperts"


class _TransposedExperts(nn.Module):
    """Experts stored [E, H, 2I] (transposed), as some transformers classes declare."""

    def __init__(self) -> None:
        super().__init__()
        self.num_experts = 4
        self.is_transposed = True
        self.gate_up_proj = nn.Parameter(torch.zeros(4, 8, 8))
        self.down_proj = nn.Parameter(torch.zeros(4, 4, 8))
        self.act_fn = nn.SiLU()

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        return hidden_states


def test_layout_errors_name_module_class_and_reason() -> None:
    model = nn.Module()
    model.block = nn.Module()
    model.block.experts = _TransposedExperts()
    with pytest.raises(
        ModelLoadError, match=r"block\.experts \(_TransposedExperts\): .*is_transposed=True"
    ):
        unfuse_experts(model)
    conv = nn.Sequential(nn.Conv1d(4, 4, 3))  # 3-D weights that are no experts are left alone
    assert not unfuse_experts(conv)


@pytest.mark.parametrize(
    ("tokens", "in_features", "ratio", "expected"),
    [
        (0, 64, 0.0, False),  # never solve on an empty Hessian
        (1, 64, 0.0, True),
        (63, 64, 1.0, False),
        (64, 64, 1.0, True),
        (127, 64, 2.0, False),
        (128, 64, 2.0, True),
        (32, 64, 0.5, True),
        (31, 64, 0.5, False),
    ],
)
def test_expert_fallback_policy(
    tokens: int, in_features: int, ratio: float, expected: bool
) -> None:
    assert enough_expert_tokens(tokens, in_features, ratio) is expected


def test_expert_fallback_default_and_errors() -> None:
    assert DEFAULT_EXPERT_TOKEN_RATIO == 2.0
    assert enough_expert_tokens(4095, 2048) is False
    assert enough_expert_tokens(4096, 2048) is True
    with pytest.raises(ValueError, match="token_count must be an int >= 0, got -1"):
        enough_expert_tokens(-1, 64)
    with pytest.raises(ValueError, match="in_features must be an int > 0, got 0"):
        enough_expert_tokens(5, 0)
    with pytest.raises(ValueError, match="threshold_ratio must be a finite number >= 0, got nan"):
        enough_expert_tokens(5, 64, float("nan"))
    with pytest.raises(ValueError, match="threshold_ratio must be a finite number >= 0, got -0.5"):
        enough_expert_tokens(5, 64, -0.5)
