"""Int8 KV-cache quantization numerics (``dynamic_cache``, msModelSlim's "C8"): pure functions.

What is quantized is what the attention writes into its KV cache: the key states after the key
norm and the rotary embedding, the value states as ``v_proj`` computes them, each shaped
``[batch, kv_heads, tokens, head_dim]``. A channel is one ``(kv_head, dim)`` pair, numbered
``head * head_dim + dim`` (the order of ``k_proj`` / ``v_proj``'s output features), and gets one
symmetric scale ``max(|min|, |max|) / 127`` over every calibration token (min and max widened to
include 0, the scale at least float32's eps), with offset 0: ``codes = clamp(round(x / scale),
-128, 127)``. The scale and offset are stored float32, shape ``[kv_heads * head_dim]``, as
msModelSlim 26.1.0 stores them (float32 for a bfloat16 model too, established on its exports).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from msquant.plugin.numerics import compute_qparams, qrange

__all__ = ["KV_BITS", "KVRange", "kv_channels", "kv_qparams", "fake_quantize_kv"]

#: The KV cache's integer width (C8).
KV_BITS = 8


def kv_channels(states: torch.Tensor) -> torch.Tensor:
    """``[batch, kv_heads, tokens, head_dim]`` states as ``[batch * tokens, kv_heads * head_dim]``
    rows (channel ``head * head_dim + dim``).

    :raises ValueError: for states that are not 4-D.
    """
    if states.dim() != 4:
        raise ValueError(
            f"KV states of shape {tuple(states.shape)}; expected [batch, kv_heads, tokens, head_dim]"
        )
    batch, heads, tokens, dim = states.shape
    return states.transpose(1, 2).reshape(batch * tokens, heads * dim)


def kv_qparams(min_val: torch.Tensor, max_val: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-channel ``(scale, offset)`` of a channel range, float32 (offset zero)."""
    scale, offset = compute_qparams(min_val, max_val, KV_BITS, True)
    return scale.contiguous(), offset.contiguous()


def fake_quantize_kv(states: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``states`` rounded to the int8 grid of ``scale`` (per channel) and back, in their dtype."""
    qmin, qmax = qrange(KV_BITS)
    rows = kv_channels(states).float()
    codes = torch.clamp(torch.round(rows / scale.float()), qmin, qmax)
    batch, heads, tokens, dim = states.shape
    back = (codes * scale.float()).reshape(batch, tokens, heads, dim).transpose(1, 2)
    return back.to(states.dtype)


@dataclass
class KVRange:
    """The running per-channel range of one attention's keys or values over the calibration set."""

    min_val: torch.Tensor | None = None
    max_val: torch.Tensor | None = None
    tokens: int = 0

    def observe(self, states: torch.Tensor) -> None:
        """Widen the range with one batch of states (``[batch, kv_heads, tokens, head_dim]``)."""
        rows = kv_channels(states.detach())
        if rows.shape[0] == 0:
            return
        low, high = rows.amin(dim=0).float().cpu(), rows.amax(dim=0).float().cpu()
        if self.min_val is None or self.max_val is None:
            self.min_val, self.max_val = low, high
        else:
            self.min_val = torch.minimum(self.min_val, low)
            self.max_val = torch.maximum(self.max_val, high)
        self.tokens += rows.shape[0]

    def absmax(self) -> float:
        """The largest ``|state|`` observed over every channel (0.0 before any token)."""
        if self.min_val is None or self.max_val is None:
            return 0.0
        return float(torch.maximum(self.min_val.abs(), self.max_val.abs()).max())

    def qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(kv_cache_scale, kv_cache_offset)`` of the range observed.

        :raises ValueError: before any token was observed.
        """
        if self.min_val is None or self.max_val is None:
            raise ValueError("no KV states were observed: run the calibration set through first")
        return kv_qparams(self.min_val, self.max_val)
