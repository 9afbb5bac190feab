"""Folds into weights shared outside the layer are found; 16-bit layers run in float32 for a
check and come back bit for bit."""

from __future__ import annotations

import torch
from torch import nn

from msquant.plugin.checks import LayerSnapshot, in_float32, shared_weight_problems


class _Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        shared = nn.Linear(4, 4, bias=False)
        self.layers = nn.ModuleList([nn.Sequential(shared, nn.Linear(4, 4)), nn.Sequential(shared)])


def test_a_weight_shared_with_another_layer_is_reported() -> None:
    model = _Two()
    assert shared_weight_problems(model, "layers.0", ["layers.0.1"]) == []
    assert shared_weight_problems(model, "layers.0", ["layers.0.0"]) == [
        "layers.0.0.weight is also the model's layers.1.0.weight: a fold into it would change "
        "that module too"
    ]


def test_in_float32_swaps_sixteen_bit_tensors_and_restores_the_originals() -> None:
    module = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)).to(torch.bfloat16)
    module.register_buffer("table", torch.randn(3).to(torch.bfloat16))
    module.register_buffer("count", torch.tensor([3]))
    tensors = {name: t for name, t in [*module.named_parameters(), *module.named_buffers()]}
    originals = {name: (t.data_ptr(), t.clone()) for name, t in tensors.items()}
    with in_float32(module) as swapped:
        assert swapped
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
            expected = torch.int64 if name == "count" else torch.float32
            assert tensor.dtype == expected, name
            assert torch.equal(tensor, originals[name][1].to(expected)), name
        out = module(torch.randn(2, 4))
        assert out.dtype == torch.float32
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        assert tensor.data_ptr() == originals[name][0], name
        assert tensor.dtype == originals[name][1].dtype and torch.equal(tensor, originals[name][1])
    with in_float32(nn.Linear(2, 2)) as swapped:
        assert not swapped


def test_a_snapshot_puts_a_layer_back_exactly() -> None:
    """Values, in-place changes, replaced tensors and a parameter added since (smooth_quant's
    zero norm bias) all go back to what they were."""
    layer = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4, bias=False)).to(torch.bfloat16)
    layer.register_buffer("table", torch.randn(3))
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    snapshot = LayerSnapshot(layer)
    with torch.no_grad():
        layer[0].weight.mul_(3)
        layer[0].bias.data = torch.zeros(4, dtype=torch.bfloat16)
        layer[1].bias = nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
        layer.table.add_(1)
    snapshot.restore()
    after = layer.state_dict()
    assert sorted(after) == sorted(before)
    assert all(torch.equal(after[k], v) and after[k].dtype == v.dtype for k, v in before.items())
    assert layer[1].bias is None
