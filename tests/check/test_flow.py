"""The data-flow proof and the function check on a hand-built layer: a Llama-shaped layer passes,
and each way of wiring it otherwise than the names say is refused with the pair and the cause."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from toy_layer import HEADS, KV_HEADS, Holder, ToyProbe, Wiring

from msquant import TransformCheckError
from msquant.plugin.checks import FlowPair, FunctionCheck, ov_channel_map, prove_flow

P = "layers.0."


def _pairs(mlp_norm: str = "post_attention_layernorm", ov_map: bool = True) -> list[FlowPair]:
    attention = tuple(P + f"self_attn.{n}_proj" for n in "qkv")
    return [
        FlowPair("norm-linear input_layernorm", P + "input_layernorm", attention),
        FlowPair(f"norm-linear {mlp_norm}", P + mlp_norm, (P + "mlp.gate_proj", P + "mlp.up_proj")),
        FlowPair(
            "ov v_proj -> o_proj",
            P + "self_attn.v_proj",
            (P + "self_attn.o_proj",),
            ov_channel_map(HEADS, KV_HEADS, 8) if ov_map else None,
        ),
        FlowPair("up-down up_proj -> down_proj", P + "mlp.up_proj", (P + "mlp.down_proj",)),
    ]


def test_ov_channel_map_follows_grouped_query_heads() -> None:
    # 4 query heads of width 2 over 2 key/value heads: heads 0, 1 read kv head 0
    assert ov_channel_map(4, 2, 4).tolist() == [0, 1, 0, 1, 2, 3, 2, 3]
    assert ov_channel_map(2, 2, 4).tolist() == [0, 1, 2, 3]


def test_a_llama_shaped_layer_proves_every_pair() -> None:
    model = Holder(Wiring())
    probe = ToyProbe(model)
    reference = prove_flow(probe, model, _pairs(), "iter_smooth")
    torch.testing.assert_close(reference, probe.run(), rtol=0, atol=0)
    errors = [error for _, check, error, _ in probe.records if check.startswith("data flow")]
    assert len(errors) == 3 + 2 + 1 + 1 + 1  # each reader of each pair, then the whole layer
    assert max(errors) < 1e-5
    assert probe.runs == 1 + 2  # plain and scaled forwards, then the one above


def test_a_norm_not_read_by_its_named_readers_is_refused() -> None:
    """Gemma's layout under Llama's names: the MLP reads pre_feedforward_layernorm."""
    model = Holder(Wiring(mlp_reads_another_norm=True))
    with pytest.raises(
        TransformCheckError,
        match=r"iter_smooth: layers\.0: the data flow the transform relies on does not hold on "
        r"this model \(checked on 20 toy tokens\): norm-linear post_attention_layernorm: the "
        r"input of mlp\.gate_proj, mlp\.up_proj does not follow post_attention_layernorm's "
        r"output channel by channel \(error [0-9.e-]+ when post_attention_layernorm's channels "
        r"are scaled\): they do not read post_attention_layernorm's output\. Fix it",
    ):
        prove_flow(ToyProbe(model), model, _pairs(), "iter_smooth", fix=". Fix it")
    # the right norm passes
    prove_flow(ToyProbe(model), model, _pairs("pre_feedforward_layernorm"), "iter_smooth")


def test_a_producer_read_by_another_module_too_is_refused() -> None:
    model = Holder(Wiring(attention_norm_also_read_elsewhere=True))
    with pytest.raises(
        TransformCheckError,
        match=r"norm-linear input_layernorm: input_layernorm's output reaches the layer's output "
        r"other than through self_attn\.q_proj, self_attn\.k_proj, self_attn\.v_proj \(the output "
        r"moved by [0-9.e-]+ with those readers' outputs held\): another module reads it",
    ):
        prove_flow(ToyProbe(model), model, _pairs(), "smooth_quant")


def test_channels_mixed_between_up_and_down_are_refused() -> None:
    model = Holder(Wiring(mlp_mixes_channels=True))
    with pytest.raises(
        TransformCheckError,
        match=r"up-down up_proj -> down_proj: the input of mlp\.down_proj does not follow "
        r"mlp\.up_proj's output channel by channel \(error [0-9.e-]+ when mlp\.up_proj's channels "
        r"are scaled\): it does not read mlp\.up_proj's output$",
    ):
        prove_flow(ToyProbe(model), model, _pairs(), "flex_smooth_quant")


def test_the_ov_pair_needs_the_grouped_query_channel_map() -> None:
    """o_proj reads each key/value head's channels once per query head: without the map, the
    proof fails (so it does check the map it is given)."""
    model = Holder(Wiring())
    with pytest.raises(TransformCheckError, match=r"ov v_proj -> o_proj: the input of"):
        prove_flow(ToyProbe(model), model, _pairs(ov_map=False), "iter_smooth")


def _smooth_mlp_norm(model: Holder, readers: tuple[str, ...]) -> None:
    """Divide post_attention_layernorm's gain by scales and multiply ``readers``' columns."""
    layer = model.layers[0]
    scales = torch.linspace(0.5, 2.0, 16)
    with torch.no_grad():
        layer.post_attention_layernorm.weight.div_(scales)
        for name in readers:
            layer.get_submodule(name).weight.mul_(scales)


def test_the_function_check_passes_an_exact_fold_and_names_a_wrong_one() -> None:
    model = Holder(Wiring())
    probe = ToyProbe(model)
    check = FunctionCheck(probe, "iter_smooth", fix=". Fix it")
    _smooth_mlp_norm(model, ("mlp.gate_proj", "mlp.up_proj"))
    assert check.verify("the norm-linear fold") < 1e-5
    _smooth_mlp_norm(model, ("mlp.gate_proj",))  # up_proj's columns forgotten
    with pytest.raises(
        TransformCheckError,
        match=r"iter_smooth: layers\.0: after the second fold the layer computes something else "
        r"on 20 toy tokens \(its outputs moved by [0-9.e-]+ of what the layer adds to its input; at "
        r"most 0\.001 is float rounding\): the transform does not keep this model's function, so "
        r"the run stops before anything is written\. Fix it",
    ):
        check.verify("the second fold")
    kinds = [(check_name.split(" ")[0], error > tol) for _, check_name, error, tol in probe.records]
    assert kinds == [("function", False), ("function", True)]


def test_the_function_check_maps_a_rotated_basis() -> None:
    """A layer whose input and output are rotated (its linears rotated as quarot does) passes
    with the maps, and fails without them."""
    model = Holder(Wiring())
    probe = ToyProbe(model)
    generator = torch.Generator().manual_seed(1)
    rotation, _ = torch.linalg.qr(torch.randn(16, 16, generator=generator))
    layer = model.layers[0]

    def unrotate(x: torch.Tensor) -> torch.Tensor:
        return x @ rotation.T

    check = FunctionCheck(probe, "quarot", to_original=unrotate, from_transformed=unrotate)
    with torch.no_grad():
        for norm, readers in (
            (
                layer.input_layernorm,
                [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj],
            ),
            (layer.post_attention_layernorm, [layer.mlp.gate_proj, layer.mlp.up_proj]),
        ):
            for reader in readers:
                reader.weight.copy_(reader.weight * norm.weight @ rotation)
            norm.weight.fill_(1.0)
        for writer in (layer.self_attn.o_proj, layer.mlp.down_proj):
            writer.weight.copy_(rotation.T @ writer.weight)
    assert check.verify("the rotation") < 1e-5
    plain = FunctionCheck(probe, "quarot", reference=check.previous)
    with pytest.raises(TransformCheckError):
        plain.verify("the rotation, unmapped")


def test_probe_forwards_leave_other_hooks_out_and_in_place() -> None:
    """A probe forward does not call hooks another processor has on the layer (in a group, a
    smoothing processor's statistics hooks are attached while another checks its folds), and the
    hooks are back, in their order, afterwards."""
    from msquant.check.hooks import check_hook, without_foreign_hooks

    layer = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    calls: list[str] = []
    layer[0].register_forward_hook(lambda *_: calls.append("first"))
    layer[0].register_forward_pre_hook(lambda *_: calls.append("pre"))
    layer[0].register_forward_hook(check_hook(lambda *_: calls.append("check")))
    layer[2].register_forward_hook(lambda *_: calls.append("last"))
    x = torch.randn(2, 4)
    with without_foreign_hooks(layer):
        layer(x)
    assert calls == ["check"]
    calls.clear()
    layer(x)
    assert calls == ["pre", "first", "check", "last"]
