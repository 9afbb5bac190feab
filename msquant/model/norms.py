"""The normalisation layers of a decoder layer: which one feeds which block, and what each computes.

Smoothing and rotation both fold something into a norm (a smoothing divides its gain by per-channel
scales; a rotation folds the gain into the linears reading it and leaves a unit gain), and both
are exact only when they know two facts about it:

* **where it sits** (:class:`NormLayout`, adapter data): the norm before the attention, the norm
  before the MLP, and any norm applied to a block's *output* before it joins the residual stream
  (Gemma 2/3's "sandwich" norms). Llama's names are the default; an architecture laid out
  otherwise declares its own layout in its model adapter
  (:attr:`msquant.plugin.ModelAdapter.norm_layout`).
* **what it computes** (:func:`measure_norm_form`, measured, never assumed): ``x / rms(x) *
  (offset + weight)`` (RMSNorm; ``offset`` 1 for the norms of Gemma and Qwen3-Next, which store
  the gain minus one) or ``(x - mean(x)) / std(x) * (offset + weight) + bias`` (LayerNorm). The
  form is read off the module's outputs on a synthetic input, so a model whose norms do something
  else is refused instead of folded wrongly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["NormForm", "NormLayout", "measure_norm_form", "norm_form_problem"]

#: Offsets a norm's gain may carry (``offset + weight``): 0 for the usual norms, 1 for the norms
#: storing their gain minus one.
KNOWN_OFFSETS = (0.0, 1.0)
#: Rows and seed of the synthetic input the form is measured on.
PROBE_ROWS = 4
PROBE_SEED = 0


@dataclass(frozen=True)
class NormLayout:
    """Where a decoder layer's norms sit, names relative to the layer (model-adapter data).

    :param attention: the norm whose output the attention block reads (Llama's
        ``input_layernorm``).
    :param mlp: the norm whose output the MLP reads (Llama's ``post_attention_layernorm``;
        Gemma 2/3's ``pre_feedforward_layernorm``).
    :param branch: norms applied to a block's output before it is added to the residual stream
        (Gemma 2/3's ``post_attention_layernorm`` and ``post_feedforward_layernorm``): a rotation
        of the stream passes through such a norm only when its gain is the same for every channel.
    """

    attention: str = "input_layernorm"
    mlp: str = "post_attention_layernorm"
    branch: tuple[str, ...] = ()


@dataclass(frozen=True)
class NormForm:
    """What a norm computes.

    :param centered: whether it subtracts the mean first (LayerNorm) or not (RMSNorm).
    :param offset: its gain is ``offset + weight`` (0 or 1).
    :param has_bias: whether it adds a bias after the gain.
    """

    centered: bool
    offset: float
    has_bias: bool

    @property
    def kind(self) -> str:
        """``LayerNorm`` or ``RMSNorm``."""
        return "LayerNorm" if self.centered else "RMSNorm"

    def describe(self) -> str:
        """The formula, e.g. ``x / rms(x) * (1 + weight)``."""
        base = "(x - mean(x)) / std(x)" if self.centered else "x / rms(x)"
        gain = "weight" if self.offset == 0 else f"({self.offset:g} + weight)"
        return f"{base} * {gain}" + (" + bias" if self.has_bias else "")


def _tolerance(dtype: torch.dtype) -> float:
    return 1e-4 if torch.finfo(dtype).bits >= 32 else 2e-2


@torch.no_grad()
def measure_norm_form(module: nn.Module) -> NormForm | None:
    """The form ``module`` computes, measured on a synthetic input, or None when it computes none
    of the known forms (or has no per-channel ``weight``).

    The input has a large mean and scale, so that an ``eps`` inside the square root is negligible
    whatever its value, and LayerNorm and RMSNorm give different outputs.
    """
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or weight.is_meta:
        return None
    bias = getattr(module, "bias", None)
    bias = bias if isinstance(bias, torch.Tensor) and bias.shape == weight.shape else None
    width = weight.shape[0]
    generator = torch.Generator().manual_seed(PROBE_SEED)
    x = torch.randn(PROBE_ROWS, width, generator=generator, dtype=torch.float64) * 10 + 3
    x = x.to(weight.dtype)
    try:
        got = module(x.to(weight.device))
    except Exception:  # noqa: BLE001 - a module that cannot run on a plain [rows, width] input
        return None
    if not isinstance(got, torch.Tensor) or got.shape != x.shape:
        return None
    got = got.to(torch.float64).cpu()
    x64 = x.to(torch.float64)
    gain = weight.detach().to(torch.float64).cpu()
    shift = 0.0 if bias is None else bias.detach().to(torch.float64).cpu()
    tolerance = _tolerance(weight.dtype)
    scale = float(got.abs().max().clamp(min=1e-12))
    for centered in (False, True):
        base = x64 - x64.mean(-1, keepdim=True) if centered else x64
        normalized = base * torch.rsqrt(base.pow(2).mean(-1, keepdim=True))
        for offset in KNOWN_OFFSETS:
            expected = normalized * (offset + gain) + shift
            if float((got - expected).abs().max()) <= tolerance * scale:
                return NormForm(centered, offset, bias is not None)
    return None


def norm_form_problem(
    module: nn.Module,
    name: str,
    declared_offset: float | None,
    allow_centered: bool,
    allow_bias: bool,
) -> tuple[NormForm | None, str | None]:
    """Measure ``module``'s form and say why it cannot be folded (None when it can).

    :param declared_offset: the offset the model adapter declares (None: not declared, the
        measured one is used).
    :param allow_centered: whether LayerNorm is acceptable (smoothing: yes; rotation: no).
    :param allow_bias: whether a bias after the gain is acceptable.
    :returns: ``(form, problem)``: the measured form (None when unknown) and the reason it cannot
        be used, or None.
    """
    form = measure_norm_form(module)
    kind = type(module).__name__
    if form is None:
        return None, (
            f"{name} ({kind}) computes neither x / rms(x) * (offset + weight) nor "
            "(x - mean(x)) / std(x) * (offset + weight) + bias (measured on a synthetic input), "
            "so a scale cannot be folded into it"
        )
    if declared_offset is not None and form.offset != declared_offset:
        return form, (
            f"{name} ({kind}) computes {form.describe()}, but the model adapter declares norms "
            f"scaling by {declared_offset:g} + weight (norm_scale_offset): fix the adapter"
        )
    if form.centered and not allow_centered:
        return form, f"{name} ({kind}) is a LayerNorm ({form.describe()}); RMSNorm is needed"
    if form.has_bias and not allow_bias:
        return form, f"{name} ({kind}) adds a bias ({form.describe()}); RMSNorm is needed"
    return form, None
