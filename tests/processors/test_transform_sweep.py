"""The architecture sweep (issue 23): every causal-LM architecture of transformers that can be built
tiny from a config runs each function-preserving transform float-only (``smooth_quant``,
``iter_smooth``, ``flex_smooth_quant``, ``quarot``), and either keeps the logits (within 1e-3 of
their range) or is refused with msquant's error (a message saying why; exit code 2 in the CLI).
None is silently wrong, and none fails otherwise.

The families msquant supports must keep the logits (not merely be refused): a check that refused
everything would pass the first rule.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import warnings
from typing import Any

import pytest
import torch
from architecture_sweep import CAUSAL_LM_TYPES, VOCAB, tiny_causal_lm
from torch import nn

from msquant import MsquantInputError
from msquant.plugin import Processor, RunContext, adapter_for
from msquant.plugin.devices import get_backend
from msquant.processors.quarot.config import QuaRotConfig
from msquant.processors.quarot.processor import QuaRot
from msquant.processors.smoothing.config import (
    FlexSmoothQuantConfig,
    IterSmoothConfig,
    SmoothQuantConfig,
)
from msquant.processors.smoothing.processor import (
    FlexSmoothQuantProcessor,
    IterSmoothProcessor,
    SmoothQuantProcessor,
)
from msquant.run.runner import run_layer_wise

TRANSFORMS: dict[str, Any] = {
    "smooth_quant": lambda: SmoothQuantProcessor(SmoothQuantConfig(type="smooth_quant")),
    "iter_smooth": lambda: IterSmoothProcessor(IterSmoothConfig(type="iter_smooth")),
    "flex_smooth_quant": lambda: FlexSmoothQuantProcessor(
        FlexSmoothQuantConfig(type="flex_smooth_quant")
    ),
    "quarot": lambda: QuaRot(QuaRotConfig(type="quarot")),
}
#: Largest logits error, relative to the logits' range, of a kept transform.
TOLERANCE = 1e-3
#: Families each transform must keep (they are Llama-shaped, or msquant has their adapter).
MUST_KEEP = {
    "smooth_quant": {"llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "gemma3_text"},
    "iter_smooth": {"llama", "qwen2", "qwen3", "qwen3_moe", "mixtral", "gemma2", "gemma3_text"},
    "flex_smooth_quant": {"llama", "qwen2", "qwen3_moe", "deepseek_v3", "gemma3_text"},
    "quarot": {"llama", "qwen2", "qwen3", "qwen3_moe", "mixtral", "deepseek_v3", "qwen3_next"},
}
#: Fewest architectures that must run (131 build tiny with transformers 5.24; a change of the
#: sweep or of transformers that loses many of them must be looked at).
MIN_ARCHITECTURES = 100
OUTCOMES: dict[str, dict[str, str]] = {}


def _samples() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (1, 24), generator=generator) for _ in range(3)]


def _logits(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=tokens, use_cache=False).logits


def _transform(model: nn.Module, processor: Processor, samples: list[torch.Tensor]) -> str | None:
    """Run ``processor`` over ``model`` as a run does (experts split, the model checked on its
    layers first); returns the refusal, None when it ran."""
    adapter = adapter_for(model)
    adapter.unfuse_experts(model)
    layers = adapter.decoder_layers(model)
    problems = processor.check_model(model, layers)
    if problems:
        return "; ".join(problems)
    ctx = RunContext(model, None, None, get_backend("cpu"), layers)  # type: ignore[arg-type]
    run_layer_wise(ctx, [processor], samples, progress=False)
    return None


def _outcome(
    base: nn.Module, name: str, samples: list[torch.Tensor], reference: torch.Tensor
) -> str:
    model = copy.deepcopy(base)
    try:
        refusal = _transform(model, TRANSFORMS[name](), samples)
    except MsquantInputError as error:
        refusal = str(error)
    if refusal is not None:
        assert len(refusal) > 40, refusal  # a message that says something
        return "refused"
    error = float((_logits(model, samples[0]) - reference).abs().max())
    scale = float(reference.max() - reference.min())
    assert error <= TOLERANCE * scale, f"{name} changed the logits by {error / scale:.3g}"
    return "kept"


@pytest.mark.parametrize("model_type", CAUSAL_LM_TYPES)
def test_each_transform_keeps_the_logits_or_is_refused(model_type: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.disable(logging.WARNING)
        try:
            base, reason = tiny_causal_lm(model_type)
            if base is None:
                pytest.skip(reason)
            samples = _samples()
            try:
                reference = _logits(base, samples[0])
            except Exception as error:  # noqa: BLE001 - the architecture itself does not run tiny
                pytest.skip(f"does not run tiny: {type(error).__name__}: {str(error)[:100]}")
            if not torch.isfinite(reference).all():
                pytest.skip("non-finite logits at this size")
            OUTCOMES[model_type] = {
                name: _outcome(base, name, samples, reference) for name in TRANSFORMS
            }
        finally:
            logging.disable(logging.NOTSET)


def test_the_sweep_ran_enough_architectures_and_kept_the_supported_families() -> None:
    """Runs after the sweep (same module, so the same process: the suite's pytest-xdist workers
    take whole files, ``--dist loadfile``); meaningful only when the whole sweep ran. With
    ``MSQUANT_SWEEP_OUT`` set, the outcomes are written there as JSON (docs/smoothing.md's
    table is made from them)."""
    if len(OUTCOMES) < len(MUST_KEEP["quarot"]):
        pytest.skip("the sweep did not run in this session (a subset was selected)")
    if os.environ.get("MSQUANT_SWEEP_OUT"):
        with open(os.environ["MSQUANT_SWEEP_OUT"], "w", encoding="utf-8") as out:
            json.dump(OUTCOMES, out, indent=1, sort_keys=True)
    assert len(OUTCOMES) >= MIN_ARCHITECTURES, sorted(OUTCOMES)
    for name, families in MUST_KEEP.items():
        not_kept = {f: OUTCOMES.get(f, {}).get(name) for f in families}
        assert {f: o for f, o in not_kept.items() if o != "kept"} == {}, name
    kept = {name: sum(o[name] == "kept" for o in OUTCOMES.values()) for name in TRANSFORMS}
    assert min(kept.values()) >= 40, kept
