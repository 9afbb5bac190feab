"""A small decoder layer built by hand, with switches that break the wiring a transform assumes,
and a probe running it (the :class:`msquant.check.base.LayerRunner` the checks use)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from msquant.plugin import DecoderLayer

WIDTH, HEADS, KV_HEADS, HEAD_DIM, INNER, TOKENS = 16, 4, 2, 4, 24, 10


class RMSNorm(nn.Module):
    """``x / rms(x) * (offset + weight)``."""

    def __init__(self, width: int, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(width) + 0.5 - offset)
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return normed * (self.offset + self.weight)


class Attention(nn.Module):
    """Causal grouped-query attention with q/k/v/o projections."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(WIDTH, HEADS * HEAD_DIM, bias=False)
        self.k_proj = nn.Linear(WIDTH, KV_HEADS * HEAD_DIM, bias=False)
        self.v_proj = nn.Linear(WIDTH, KV_HEADS * HEAD_DIM, bias=False)
        self.o_proj = nn.Linear(HEADS * HEAD_DIM, WIDTH, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.q_proj(x).view(batch, seq, HEADS, HEAD_DIM).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq, KV_HEADS, HEAD_DIM).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, KV_HEADS, HEAD_DIM).transpose(1, 2)
        group = HEADS // KV_HEADS
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, HEADS * HEAD_DIM))


class MLP(nn.Module):
    def __init__(self, mix_channels: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(WIDTH, INNER, bias=False)
        self.up_proj = nn.Linear(WIDTH, INNER, bias=False)
        self.down_proj = nn.Linear(INNER, WIDTH, bias=False)
        self.mix_channels = mix_channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inner = torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x)
        if self.mix_channels:  # a cross-channel operation between up_proj and down_proj
            inner = inner + inner.roll(1, dims=-1)
        return self.down_proj(inner)


@dataclass
class Wiring:
    """How the toy layer breaks a Llama-shaped layout (all False: it is Llama-shaped)."""

    mlp_reads_another_norm: bool = False  # a sandwich norm layout, named as Llama's
    attention_norm_also_read_elsewhere: bool = False  # a parallel reader of input_layernorm
    mlp_mixes_channels: bool = False
    norm_offset: float = 0.0
    extra: dict[str, bool] = field(default_factory=dict)


class ToyLayer(nn.Module):
    def __init__(self, wiring: Wiring) -> None:
        super().__init__()
        self.wiring = wiring
        self.input_layernorm = RMSNorm(WIDTH, wiring.norm_offset)
        self.self_attn = Attention()
        self.post_attention_layernorm = RMSNorm(WIDTH, wiring.norm_offset)
        self.pre_feedforward_layernorm = RMSNorm(WIDTH, wiring.norm_offset)
        self.mlp = MLP(wiring.mlp_mixes_channels)
        self.side = nn.Linear(WIDTH, WIDTH, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = self.input_layernorm(x)
        attention = self.self_attn(normed)
        if self.wiring.attention_norm_also_read_elsewhere:
            attention = attention + self.side(normed)
        if self.wiring.mlp_reads_another_norm:  # Gemma's sandwich: a norm on the output
            h = x + self.post_attention_layernorm(attention)
            return h + self.mlp(self.pre_feedforward_layernorm(h))
        h = x + attention
        return h + self.mlp(self.post_attention_layernorm(h))


class Holder(nn.Module):
    """A model holding the layer as ``layers.0`` (the checks name modules by full names)."""

    def __init__(self, wiring: Wiring, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.layers = nn.ModuleList([ToyLayer(wiring)])


class ToyProbe:
    """Runs ``layers.0`` of a :class:`Holder` on fixed hidden states; keeps every record."""

    def __init__(self, model: Holder, dtype: torch.dtype = torch.float32) -> None:
        self.model = model
        self._layer = DecoderLayer(0, "layers.0", model.layers[0])
        generator = torch.Generator().manual_seed(7)
        self.input = torch.randn(2, TOKENS, WIDTH, generator=generator).to(dtype)
        self.records: list[tuple[str, str, float, float]] = []
        self.runs = 0

    @property
    def layer(self) -> DecoderLayer:
        return self._layer

    @property
    def tokens(self) -> int:
        return int(self.input.shape[0] * self.input.shape[1])

    def describe(self) -> str:
        return f"{self.tokens} toy tokens"

    def hidden(self) -> torch.Tensor:
        return self.input.float()

    @torch.no_grad()
    def run(self, hidden: torch.Tensor | None = None) -> torch.Tensor:
        self.runs += 1
        inputs = self.hidden() if hidden is None else hidden
        return self._layer.module(inputs.to(self.input.dtype)).float()

    def record(self, processor: str, check: str, error: float, tolerance: float) -> None:
        self.records.append((processor, check, error, tolerance))
