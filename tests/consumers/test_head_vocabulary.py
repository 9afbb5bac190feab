"""Issue 13 §1 #4 with the engines' own code: a quantized head whose vocabulary is not a multiple
of 64.

vLLM 0.33 and SGLang 0.5.23 build the output head as a ``ParallelLMHead`` padded to a multiple of
64 rows (``DEFAULT_VOCAB_PADDING_SIZE``); the quantization method creates its parameters for the
padded vocabulary, and the head's ``weight_loader`` copies a checkpoint tensor into the first rows
of the parameter (``param[: loaded.shape[0]].copy_(loaded)``). GPTQ keeps the vocabulary in
dimension 1 (``qweight [in / pack, vocab]``), so a vocabulary of 400 cannot be copied into the
448 columns; compressed-tensors keeps it in dimension 0, which the loader pads. The engines'
real heads and loaders (:mod:`vllm_head`, :func:`sglang_engine.lm_head`) are run on the exports.
Opt-in (``pytest -m consumers``).
"""

from __future__ import annotations

import pytest
import sglang_engine
import vllm_engine
import vllm_head
from architectures import engine_modules
from cases import GPTQ_SERVED, HEAD_VOCAB_400, VOCAB_400
from exports import Export, ExportFactory
from torch import nn
from weight_loaders import load_layer

import msquant

pytestmark = [pytest.mark.consumers, pytest.mark.usefixtures("vllm")]

ENGINES = ("vllm", "sglang")


def real_head(engine: str, export: Export) -> nn.Module:
    """The engine's own ``ParallelLMHead`` for the export, with the method its config picks."""
    module = next(m for m in engine_modules(export.model_dir, engine) if m.kind == "lm_head")  # type: ignore[arg-type]
    if engine == "vllm":
        return vllm_head.lm_head(vllm_engine.quant_config_for(export.path, "llama"), module)
    return sglang_engine.lm_head(sglang_engine.quant_config_for(export.path, "llama"), module)


@pytest.mark.parametrize("engine", ENGINES)
def test_gptq_head_of_400_tokens_does_not_load_and_msquant_warns(
    engine: str, make_export: ExportFactory
) -> None:
    export = make_export(HEAD_VOCAB_400["gptq"])
    head = real_head(engine, export)
    assert head.num_embeddings_padded == 448
    assert tuple(head.qweight.shape) == (128 // 8, 448)
    outcome = load_layer(head, export.path, "lm_head")
    refused = {name: error for name, error in outcome.items() if error}
    assert set(refused) == {"qweight", "scales", "qzeros"}, outcome
    assert "The size of tensor a (448) must match the size of tensor b (400)" in refused["qweight"]
    assert "The size of tensor a (56) must match the size of tensor b (50)" in refused["qzeros"]
    assert export.warned("lm_head is quantized, but its 400 output rows", "vLLM and SGLang")


@pytest.mark.parametrize("engine", ENGINES)
def test_gptq_head_of_384_tokens_loads(engine: str, make_export: ExportFactory) -> None:
    """The same head with a vocabulary of 384 (a multiple of 64) loads in both engines."""
    export = make_export(GPTQ_SERVED["gptq_head_same_scheme"])
    head = real_head(engine, export)
    assert head.num_embeddings_padded == 384
    outcome = load_layer(head, export.path, "lm_head")
    assert outcome and all(error is None for error in outcome.values()), outcome
    assert not export.warned("multiple of 64")


@pytest.mark.parametrize("engine", ENGINES)
def test_compressed_tensors_head_of_400_tokens_loads(
    engine: str, make_export: ExportFactory
) -> None:
    """compressed-tensors stores the vocabulary in dimension 0, which the loader pads: no
    limit, and msquant's compressed-tensors saver rightly does not warn."""
    export = make_export(HEAD_VOCAB_400["ct"])
    head = real_head(engine, export)
    assert type(head.quant_method).__name__ == "CompressedTensorsLinearMethod"
    assert tuple(head.weight_packed.shape) == (448, 128 // 8)
    outcome = load_layer(head, export.path, "lm_head")
    assert set(outcome) == {"weight_packed", "weight_scale", "weight_shape"}
    assert all(error is None for error in outcome.values()), outcome
    assert not export.warned("multiple of 64")


def test_strict_gptq_saver_refuses_the_400_token_head_before_weights_load(
    make_export: ExportFactory,
) -> None:
    case = HEAD_VOCAB_400["gptq"]
    model = make_export.model(case.arch, VOCAB_400)
    config = case.config()
    config["spec"]["save"] = [{"type": "gptq_saver", "strict": True}]
    save = model.parent / "strict_vocab400"
    with pytest.raises(msquant.QuantizationError, match="400 output rows .* multiple of 64"):
        msquant.quantize(model, save, config, progress=False)
    assert not save.exists()
