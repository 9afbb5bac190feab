"""``msquant verify --model_path``'s forward check (msquant/verify/forward.py): the logits error
against a float64 reference, the per-scheme bounds, the tokens, and every example config's honest
export passing it."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import CALIB_TXT, EXAMPLES

import msquant
from msquant.verify import export_folders
from msquant.verify.forward import (
    FORWARD_TOKENS,
    forward_tokens,
    logits_error,
    logits_error_bound,
    rounded_logits_error,
)


def test_logits_error_against_a_float64_reference() -> None:
    generator = torch.Generator().manual_seed(0)
    original = torch.randn(5, 11, generator=generator)
    noise = 0.01 * torch.randn(5, 11, generator=generator)
    shift = torch.arange(5, dtype=torch.float32)[
        :, None
    ]  # a constant per token: softmax ignores it
    relative, agreement = logits_error(original + noise + shift, original)
    a = (original + noise).double()
    b = original.double()
    a, b = a - a.mean(1, keepdim=True), b - b.mean(1, keepdim=True)
    assert relative == pytest.approx(float((a - b).norm() / b.norm()), rel=1e-6)
    assert agreement == pytest.approx(
        float(((original + noise).argmax(1) == original.argmax(1)).double().mean())
    )
    assert logits_error(original, original) == (0.0, 1.0)
    swapped = original.flip(-1)
    assert logits_error(swapped, original)[0] > 1.0


@pytest.mark.parametrize(
    ("weights", "rounded", "bound"),
    [
        (8, 0.05, 0.4),
        (16, 0.05, 0.4),
        (None, 0.05, 0.4),
        (4, 0.3, 0.6),
        (3, 0.5, 1.0),
        (8, 0.0, 0.02),
    ],
)
def test_bound_is_a_multiple_of_the_rounding_error(
    weights: int | None, rounded: float, bound: float
) -> None:
    assert logits_error_bound(weights, rounded) == pytest.approx(bound)


def test_rounding_error_grows_as_the_width_shrinks(tiny_llama: Path) -> None:
    """The reference noise of the bound: small at 8 bits, larger at 4."""
    from msquant.load.model_folder import load_causal_lm

    errors = {}
    for bits in (8, 4):
        model = load_causal_lm(tiny_llama)
        ids = forward_tokens(tiny_llama, int(model.config.vocab_size))
        with torch.no_grad():
            reference = model(input_ids=ids).logits[0].float()
        errors[bits] = rounded_logits_error(model, ids, reference, bits)
    assert 0 < errors[8] < 0.05 and errors[4] > 4 * errors[8], errors


def test_tokens_come_from_the_tokenizer_or_a_seed(tiny_llama: Path, tmp_path: Path) -> None:
    ids = forward_tokens(tiny_llama, 384)
    assert ids.shape == (1, FORWARD_TOKENS) and int(ids.max()) < 384
    bare = tmp_path / "bare"
    bare.mkdir()
    seeded = forward_tokens(bare, 100)
    assert seeded.shape == (1, FORWARD_TOKENS) and int(seeded.max()) < 100
    assert torch.equal(seeded, forward_tokens(bare, 100))  # fixed: the same tokens every time
    assert not torch.equal(seeded, ids)


@pytest.mark.parametrize("example", sorted(p.name for p in EXAMPLES.glob("*.yaml")))
def test_every_example_export_passes_the_forward_check(
    example: str, tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    """Each scheme of yaml_examples, quantized from a tiny Llama (hidden 128: the examples'
    group size 128 divides it), computes what the float model computes within its scheme's bound
    (measured errors: docs/reliability.md)."""
    model = tiny_model_factory("llama", hidden_size=128, intermediate_size=256)
    out = tmp_path / "out"
    msquant.quantize(
        model, out, EXAMPLES / example, calib_path=CALIB_TXT, max_calib_tokens=32, progress=False
    )
    for folder in export_folders(out):
        report = msquant.verify_export(folder, model_path=model)
        assert report.ok, report.errors
        assert report.forward is not None
        assert report.forward.relative_error <= report.forward.bound
        assert report.forward.tokens == FORWARD_TOKENS
    shutil.rmtree(out)
