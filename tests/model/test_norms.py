"""A norm's form is measured on its outputs: RMSNorm (scaling by weight or 1 + weight),
LayerNorm with or without bias, and anything else is unknown."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from msquant.plugin.model import NormForm, measure_norm_form, norm_form_problem


class _NotANorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(8) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


def _random(norm: nn.Module) -> nn.Module:
    with torch.no_grad():
        for parameter in norm.parameters():
            parameter.copy_(torch.rand(parameter.shape) + 0.3)
    return norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forms_of_transformers_norms(dtype: torch.dtype) -> None:
    assert measure_norm_form(_random(LlamaRMSNorm(8)).to(dtype)) == NormForm(False, 0.0, False)
    assert measure_norm_form(_random(Gemma2RMSNorm(8)).to(dtype)) == NormForm(False, 1.0, False)
    assert measure_norm_form(_random(nn.LayerNorm(8)).to(dtype)) == NormForm(True, 0.0, True)
    no_bias = _random(nn.LayerNorm(8, bias=False)).to(dtype)
    assert measure_norm_form(no_bias) == NormForm(True, 0.0, False)
    assert measure_norm_form(_NotANorm()) is None
    assert measure_norm_form(nn.LayerNorm(8, elementwise_affine=False)) is None


def test_norm_form_problems_name_the_module_and_the_fix() -> None:
    gemma = _random(Gemma2RMSNorm(8))
    assert norm_form_problem(gemma, "n", None, False, False) == (NormForm(False, 1.0, False), None)
    assert norm_form_problem(gemma, "n", 0.0, False, False)[1] == (
        "n (Gemma2RMSNorm) computes x / rms(x) * (1 + weight), but the model adapter declares "
        "norms scaling by 0 + weight (norm_scale_offset): fix the adapter"
    )
    layer_norm = _random(nn.LayerNorm(8))
    assert norm_form_problem(layer_norm, "n", None, True, True)[1] is None
    assert norm_form_problem(layer_norm, "n", None, False, True)[1] == (
        "n (LayerNorm) is a LayerNorm ((x - mean(x)) / std(x) * weight + bias); RMSNorm is needed"
    )
    assert norm_form_problem(_NotANorm(), "n", None, True, True) == (
        None,
        "n (_NotANorm) computes neither x / rms(x) * (offset + weight) nor (x - mean(x)) / "
        "std(x) * (offset + weight) + bias (measured on a synthetic input), so a scale cannot "
        "be folded into it",
    )
