"""One frozen :class:`msquant.plugin.numerics.GPTQOptions` travels from the config to the solver: the method
resolves a module's options from ``ext`` and its rule, the quantizer carries them, the solver
takes them; msModelSlim's two class names build the same value from keywords."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import msquant
import msquant.plugin
import msquant.plugin.numerics
import msquant.plugin.planning
from msquant import QuantizationError
from msquant.plugin.numerics import GPTQOptions, GPTQQuantizer, MSEOptions, gptq_quantize
from msquant.processors.linear_quant.config import LinearQuantConfig
from msquant.processors.linear_quant.processor import LinearQuantProcessor


def _layer(out: int = 16, width: int = 64, rows: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(out, width, generator=gen)
    x = torch.randn(rows, width, generator=gen) * torch.linspace(0.1, 3, width)
    return weight, x


def test_the_options_are_one_frozen_value() -> None:
    options = GPTQOptions(bits=4, group_size=32)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.bits = 8  # type: ignore[misc]
    assert options.static is False and dataclasses.replace(options, desc_act=True).static
    assert GPTQOptions(desc_act=True).static is False  # per-channel: no groups to fix


def test_the_solver_takes_the_options_or_their_fields_never_both() -> None:
    weight, x = _layer()
    hessian = 2 * x.t() @ x / x.shape[0]
    options = GPTQOptions(bits=4, symmetric=False, group_size=32, desc_act=True, percdamp=0.05)
    by_value = gptq_quantize(weight, hessian, options)
    by_fields = gptq_quantize(
        weight, hessian, bits=4, symmetric=False, group_size=32, desc_act=True, percdamp=0.05
    )
    assert torch.equal(by_value.quantized.codes, by_fields.quantized.codes)
    assert by_value.static_groups and by_value.perm is not None
    with pytest.raises(TypeError, match="pass options or its fields, not both"):
        gptq_quantize(weight, hessian, options, bits=8)


def test_the_class_names_build_the_same_quantizer() -> None:
    per_group = msquant.plugin.numerics.WeightPerGroupGPTQ(
        4, True, group_size=32, percdamp=0.05, mse=True
    )
    assert isinstance(per_group, GPTQQuantizer)
    assert per_group.options == GPTQOptions(
        bits=4, symmetric=True, group_size=32, percdamp=0.05, mse=MSEOptions()
    )
    per_channel = msquant.plugin.numerics.WeightPerChannelGPTQ(8, False, desc_act=True)
    assert per_channel.options == GPTQOptions(bits=8, symmetric=False, desc_act=True)
    with pytest.raises(TypeError):
        msquant.plugin.numerics.WeightPerChannelGPTQ(group_size=32)  # type: ignore[call-arg]
    with pytest.raises(QuantizationError, match=r"x: invalid GPTQ options: bits must be"):
        GPTQOptions.from_flat("x", bits=1)


def test_a_module_gets_ext_with_its_rule_applied() -> None:
    """The method resolves each module's options: the entry's ``ext`` and numerics defaults, a
    rule's ``bits`` / ``group_size: -1`` / ``damp_percent`` overrides; static groups never go
    with per-channel."""
    config = LinearQuantConfig.model_validate(
        {
            "qconfig": {
                "weight": {
                    "method": "gptq",
                    "dtype": "int4",
                    "scope": "per_group",
                    "ext": {"group_size": 32, "block_size": 64, "mse_grid": 50},
                }
            },
            "dynamic": {".*down_proj": {"bits": 8, "group_size": -1, "damp_percent": 0.2}},
        }
    )
    proc = LinearQuantProcessor(config)
    base = msquant.plugin.planning.resolve_module_scheme("m.up_proj", proc.base_scheme, proc.rules)
    rule = msquant.plugin.planning.resolve_module_scheme(
        "m.down_proj", proc.base_scheme, proc.rules
    )
    assert proc.method.solve_options(base) == GPTQOptions(
        bits=4, symmetric=True, group_size=32, percdamp=0.01, block_size=64, desc_act=True,
        mse=MSEOptions(grid=50), full_range=True,
    )  # fmt: skip
    assert rule.group_size is None  # GPTQModel's -1, as msquant encodes per-channel
    assert proc.method.solve_options(rule) == GPTQOptions(
        bits=8, symmetric=True, group_size=None, percdamp=0.2, block_size=64, desc_act=True,
        mse=MSEOptions(grid=50),  # the entry's search (its int4 qconfig); a rule's mse: would change it
    )  # fmt: skip
