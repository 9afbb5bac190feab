"""Why quarot hurts round-to-nearest int4 weights on SmolLM2: per-token output error of the linears
reading a norm, with the norm's gain left in the activations (the unrotated model), folded into
the weights (what quarot does first), and folded then rotated (quarot), for the first token of
each window (the attention sink, which carries the massive activations) and the other tokens.

It also prints how much of each token's normalized input lies in channels whose norm gain is
near zero (under 1 % of the median gain): the model damps its massive activations there, and a
rotation spreads them over every channel (docs/accuracy.md, "Rotation (quarot)").

Usage::

    python bench/rotation_outliers.py --model_dir models/SmolLM2-135M-Instruct --text wiki.txt \\
        [--layers 1,5,15,25] [--windows 2] [--seqlen 512]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from msquant.quant.int_quant import dequantize, minmax_qparams, quantize
from msquant.quant.rotation import rotation_for

#: (name, norm, reader) per part of a decoder layer.
PARTS = (
    ("attn", "input_layernorm", "self_attn.q_proj"),
    ("mlp", "post_attention_layernorm", "mlp.gate_proj"),
)


def int4_rtn(weight: torch.Tensor) -> torch.Tensor:
    """Symmetric int4 per-output-channel round-to-nearest (msquant's ``minmax`` quantizer, in
    float32 as in a run), dequantized back to ``weight``'s dtype."""
    scale, offset = minmax_qparams(weight, 4, True, None)
    codes = quantize(weight, scale, offset, 4, None)
    return dequantize(codes, scale, offset, None).to(weight.dtype)


def relative_error(got: torch.Tensor, want: torch.Tensor, rows: torch.Tensor) -> float:
    """Root of the error energy over the reference energy, on the selected token rows."""
    return float(((got - want)[rows].pow(2).sum() / want[rows].pow(2).sum()).sqrt())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model_dir", type=Path, required=True)
    parser.add_argument("--text", type=Path, required=True)
    parser.add_argument("--layers", default="1,5,15,25")
    parser.add_argument("--windows", type=int, default=2)
    parser.add_argument("--seqlen", type=int, default=512)
    args = parser.parse_args()
    layers = [int(i) for i in args.layers.split(",")]
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32).eval()
    tokens = args.windows * args.seqlen
    ids = tokenizer(args.text.read_text(encoding="utf-8")[: tokens * 20], return_tensors="pt")
    ids = ids.input_ids[:, :tokens].reshape(args.windows, args.seqlen)
    width = model.config.hidden_size
    rotation = rotation_for(width, -1, dtype=torch.float64)
    normalized: dict[tuple[int, str], torch.Tensor] = {}

    def capture(key: tuple[int, str], eps: float):  # type: ignore[no-untyped-def]
        def hook(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], output: object) -> None:
            x = inputs[0].detach().to(torch.float64).reshape(-1, width)
            normalized[key] = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)

        return hook

    for index in layers:
        layer = model.model.layers[index]
        for part, norm, _ in PARTS:
            module = layer.get_submodule(norm)
            module.register_forward_hook(capture((index, part), module.variance_epsilon))
    with torch.no_grad():
        model(ids)
    first = torch.zeros(tokens, dtype=torch.bool)
    first[:: args.seqlen] = True
    print("share of the normalized input in near-zero-gain channels, and the reader's relative")
    print("output error under int4 round-to-nearest; each cell: first tokens / other tokens")
    print(
        f"{'layer reader':<20} {'share':>15} {'gain unfolded':>15} {'folded':>15} {'rotated':>15}"
    )
    for index in layers:
        layer = model.model.layers[index]
        for part, norm, reader in PARTS:
            gain = layer.get_submodule(norm).weight.detach().to(torch.float64)
            weight = layer.get_submodule(reader).weight.detach().to(torch.float64)
            x = normalized[(index, part)]
            small = gain.abs() < 0.01 * gain.abs().median()
            share = x[:, small].pow(2).sum(1) / x.pow(2).sum(1)
            folded = weight * gain
            want = x @ folded.T
            outputs = (
                (x * gain) @ int4_rtn(weight).T,
                x @ int4_rtn(folded).T,
                (x @ rotation) @ int4_rtn(folded @ rotation).T,
            )
            cells = [f"{share[first].mean():.3f} / {share[~first].mean():.3f}"]
            cells += [
                f"{relative_error(o, want, first):.3f} / {relative_error(o, want, ~first):.3f}"
                for o in outputs
            ]
            label = f"{index} {reader}"
            print(f"{label:<20} " + " ".join(f"{c:>15}" for c in cells))


if __name__ == "__main__":
    main()
