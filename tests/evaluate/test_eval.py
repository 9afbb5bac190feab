"""``msquant eval`` and ``msquant.evaluate_perplexity``: perplexity of float models and exports.

The perplexity is checked against a straightforward computation with the model's own loss
(``labels``), exports of every format against the float model with its weights replaced by hand
with the fake-quantized ones, and the CLI for its output, JSON and exit codes.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import CALIB_TXT, CliResult
from transformers import AutoModelForCausalLM, AutoTokenizer

import msquant
import msquant.plugin
import msquant.plugin.numerics
from msquant.evaluate.data import read_eval_tokens
from msquant.evaluate.models import load_model_for_eval
from msquant.evaluate.run_evaluation import prepare_evaluation
from msquant.evaluate.windows import measure_perplexity, sliding_window_perplexity, sliding_windows
from msquant.load.model_folder import load_model_config
from msquant.report.run_report import REPORT_FILE

SEQLEN = 64
TEXT_CHARS = 2500  # the start of calib.txt: about 1,000 tokens of the tiny tokenizer
INT8_ATTENTION = {"dtype": "int8", "scope": "per_channel", "symmetric": True, "method": "minmax"}
INT4_MLP = {
    "dtype": "int4",
    "scope": "per_group",
    "symmetric": False,
    "method": "minmax",
    "ext": {"group_size": 32},
}
SAVERS = ("ascendv1_saver", "mindie_format_saver", "gptq_saver", "compressed_tensors")
FORMATS = {
    "ascendv1_saver": "ascend",
    "mindie_format_saver": "mindie",
    "gptq_saver": "gptq",
    "compressed_tensors": "compressed-tensors",
}


# --- fixtures and references -----------------------------------------------------------------


@pytest.fixture(scope="module")
def tied_llama(tiny_model_factory: Callable[..., Path]) -> Path:
    """A tiny Llama whose output head is tied to the embeddings (stored once in every export)."""
    return tiny_model_factory("llama", tie_word_embeddings=True)


@pytest.fixture(scope="module")
def exports(tied_llama: Path, text: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One run, four savers: attention int8 per-channel symmetric, MLP int4 group-32 asymmetric;
    the run also measures its in-memory model's perplexity on ``text``."""
    save_path = tmp_path_factory.mktemp("eval") / "out"
    config = {
        "apiversion": "modelslim_v1",
        "spec": {
            "process": [
                {
                    "type": "linear_quant",
                    "qconfig": {"weight": INT8_ATTENTION},
                    "include": ["*self_attn*"],
                },
                {"type": "linear_quant", "qconfig": {"weight": INT4_MLP}, "include": ["*mlp*"]},
            ],
            "save": [{"type": saver} for saver in SAVERS],
        },
    }
    msquant.quantize(
        tied_llama, save_path, config, progress=False, eval_data=text, eval_seqlen=SEQLEN
    )
    return save_path


@pytest.fixture(scope="module")
def text(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A short evaluation text (the tests need a few dozen windows, not the whole file)."""
    path = tmp_path_factory.mktemp("eval_text") / "text.txt"
    path.write_text(CALIB_TXT.read_text(encoding="utf-8")[:TEXT_CHARS], encoding="utf-8")
    return path


def _tokens(model_dir: Path, data: Path) -> torch.Tensor:
    return read_eval_tokens(data, AutoTokenizer.from_pretrained(str(model_dir)))


def _float_model(model_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()


def _reference_ppl(model: torch.nn.Module, ids: torch.Tensor, seqlen: int, stride: int) -> float:
    """The Hugging Face recipe, written out: each window's loss from ``labels`` (new tokens only,
    older ones masked with -100), averaged in float64 weighted by the tokens it scored."""
    total, count, previous_end = 0.0, 0, 0
    for begin in range(0, ids.numel(), stride):
        end = min(begin + seqlen, ids.numel())
        chunk = ids[begin:end].unsqueeze(0)
        labels = chunk.clone()
        labels[0, : max(previous_end - begin, 0)] = -100
        scored = int((labels[0, 1:] != -100).sum())
        if scored:
            with torch.no_grad():
                loss = model(input_ids=chunk, labels=labels).loss
            total += float(loss) * scored
            count += scored
        previous_end = end
        if end == ids.numel():
            break
    return math.exp(total / count)


def _fake_quantized(model_dir: Path, fp16_scales: bool = False) -> torch.nn.Module:
    """The float model with every decoder linear replaced by hand with its fake-quantized weight."""
    model = _float_model(model_dir)
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or ".layers." not in name:
            continue
        spec = INT8_ATTENTION if "self_attn" in name else INT4_MLP
        bits = 8 if spec["dtype"] == "int8" else 4
        group_size = spec.get("ext", {}).get("group_size")
        qw = msquant.plugin.numerics.quantize_weight_minmax(
            module.weight.detach(), bits, bool(spec["symmetric"]), group_size
        )
        if fp16_scales:  # GPTQ checkpoints store scales in float16 by definition of the format
            qw = msquant.plugin.QuantizedWeight(
                qw.codes, qw.scale.half().float(), qw.offset, bits, qw.symmetric, group_size
            )
        with torch.no_grad():
            module.weight.copy_(qw.dequantize())
    return model


# --- windows ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("total", "seqlen", "stride"), [(1000, 64, 64), (1000, 64, 16), (7, 4, 3)])
def test_windows_score_each_token_at_most_once(total: int, seqlen: int, stride: int) -> None:
    """Overlapping windows score every token but the very first exactly once; non-overlapping
    ones every token but each window's first (which has no context in its window)."""
    windows = sliding_windows(total, seqlen, stride)
    scored = [t for w in windows for t in range(w.score_from, w.end)]
    unscored = {0} if stride < seqlen else {w.begin for w in windows}
    assert scored == [t for t in range(total) if t not in unscored]
    for w in windows:
        assert w.end - w.begin <= seqlen and w.begin % stride == 0
        assert w.begin < w.score_from  # every scored token has context inside its window
    if stride < seqlen:  # after the first window, each token sees at least seqlen - stride before
        assert all(w.score_from - w.begin >= seqlen - stride for w in windows[1:-1])
    assert sliding_windows(total, seqlen, stride, max_samples=2) == windows[:2]


def test_window_settings_out_of_range_are_refused() -> None:
    with pytest.raises(msquant.EvaluationError, match="stride must be between 1 and seqlen"):
        sliding_windows(100, 16, 32)
    with pytest.raises(msquant.EvaluationError, match="max_samples must be a positive integer"):
        sliding_windows(100, 16, 16, 0)


# --- perplexity ---------------------------------------------------------------------------------


def test_perplexity_matches_the_models_own_loss(tiny_llama: Path, text: Path) -> None:
    result = msquant.evaluate_perplexity(tiny_llama, text, seqlen=SEQLEN)
    ids = _tokens(tiny_llama, text)
    expected = _reference_ppl(_float_model(tiny_llama), ids, SEQLEN, SEQLEN)
    assert result.ppl == pytest.approx(expected, rel=1e-6)
    assert result.nll == pytest.approx(math.log(expected), rel=1e-6)
    assert result.kind == "float" and result.text_tokens == ids.numel()
    assert result.windows == math.ceil(ids.numel() / SEQLEN)
    assert result.tokens == ids.numel() - result.windows  # each window's first token has no context
    assert result.stride == SEQLEN and result.seconds > 0


def test_overlapping_windows_score_only_new_tokens(tiny_llama: Path, text: Path) -> None:
    result = msquant.evaluate_perplexity(tiny_llama, text, seqlen=SEQLEN, stride=16)
    ids = _tokens(tiny_llama, text)
    assert result.tokens == ids.numel() - 1
    assert result.windows == math.ceil((ids.numel() - SEQLEN) / 16) + 1
    expected = _reference_ppl(_float_model(tiny_llama), ids, SEQLEN, 16)
    assert result.ppl == pytest.approx(expected, rel=1e-6)


def test_max_samples_limits_the_windows_and_is_deterministic(tiny_llama: Path, text: Path) -> None:
    first = msquant.evaluate_perplexity(tiny_llama, text, seqlen=SEQLEN, max_samples=5)
    again = msquant.evaluate_perplexity(tiny_llama, text, seqlen=SEQLEN, max_samples=5)
    assert (first.windows, first.tokens) == (5, 5 * (SEQLEN - 1))
    assert again.ppl == first.ppl and again.nll == first.nll


@pytest.mark.parametrize("saver", SAVERS)
def test_export_evaluates_to_the_hand_fake_quantized_model(
    saver: str, exports: Path, tied_llama: Path, text: Path
) -> None:
    """Bit-exact: the export read back equals quantize_weight_minmax(...).dequantize() by hand."""
    result = msquant.evaluate_perplexity(exports / saver, text, seqlen=SEQLEN)
    assert result.kind == FORMATS[saver]
    hand = _fake_quantized(tied_llama, fp16_scales=saver == "gptq_saver")
    nll, tokens, windows = sliding_window_perplexity(hand, _tokens(tied_llama, text), SEQLEN)
    assert (result.tokens, result.windows) == (tokens, windows)
    assert result.nll == nll / tokens  # exactly: the same weights, bit for bit
    float_nll, _, _ = sliding_window_perplexity(
        _float_model(tied_llama), _tokens(tied_llama, text), SEQLEN
    )
    assert result.nll != float_nll / tokens  # the quantized weights really were substituted


def test_tied_head_is_the_stored_embedding(exports: Path, tied_llama: Path) -> None:
    model, kind = load_model_for_eval(exports / "gptq_saver")
    assert kind == "gptq"
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, _float_model(tied_llama).lm_head.weight)


def test_inconsistent_export_is_refused_naming_verify(
    exports: Path, tmp_path: Path, text: Path
) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(exports / "ascendv1_saver", broken)
    description = broken / "quant_model_description.json"
    data = json.loads(description.read_text(encoding="utf-8"))
    del data["model.layers.0.mlp.up_proj.weight_scale"]
    description.write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises(msquant.ExportReadError, match="msquant verify") as info:
        msquant.evaluate_perplexity(broken, text, seqlen=SEQLEN)
    assert "model.layers.0.mlp.up_proj.weight_scale" in str(info.value)


# --- the evaluation of a quantization run ------------------------------------------------------


def test_measure_perplexity_is_the_sliding_window_core(tiny_llama: Path, text: Path) -> None:
    ids = _tokens(tiny_llama, text)
    model = _float_model(tiny_llama)
    measured = measure_perplexity(model, ids, SEQLEN, 16, 7)
    nll, tokens, windows = sliding_window_perplexity(model, ids, SEQLEN, 16, 7)
    assert (measured.tokens, measured.windows, measured.text_tokens) == (tokens, 7, ids.numel())
    assert measured.nll == nll / tokens and measured.ppl == math.exp(nll / tokens)
    assert windows == 7 and measured.seconds > 0


def test_prepare_evaluation_checks_everything_before_a_model_is_loaded(
    tiny_llama: Path, text: Path, tmp_path: Path
) -> None:
    prepared = prepare_evaluation(text, SEQLEN, max_samples=3)
    assert prepared.settings() == {
        "data": str(text),
        "data_sha256": hashlib.sha256(text.read_bytes()).hexdigest(),
        "seqlen": SEQLEN,
        "stride": SEQLEN,
        "max_samples": 3,
    }
    assert torch.equal(prepared.tokens(AutoTokenizer.from_pretrained(str(tiny_llama))),
                       _tokens(tiny_llama, text))  # fmt: skip
    with pytest.raises(msquant.EvaluationError, match="stride must be between 1 and seqlen"):
        prepare_evaluation(text, 16, 32)
    with pytest.raises(msquant.EvaluationError, match="nope.txt does not exist"):
        prepare_evaluation(tmp_path / "nope.txt")
    with pytest.raises(msquant.EvaluationError, match=r"pass --eval_seqlen 512 or less"):
        prepare_evaluation(text, 1024).check_model(load_model_config(tiny_llama), tiny_llama)


@pytest.mark.parametrize("saver", SAVERS)
def test_run_report_perplexity_equals_eval_of_the_export(
    saver: str, exports: Path, text: Path, run_cli: Callable[..., CliResult], tmp_path: Path
) -> None:
    """``quant --eval_data`` evaluates the in-memory model; ``msquant eval`` reads the export
    back: the same weights, so the same numbers (GPTQ stores its scales in float16, the one
    place the export rounds what the run computed)."""
    evaluation = json.loads((exports / REPORT_FILE).read_text(encoding="utf-8"))["evaluation"]
    out = tmp_path / "ppl.json"
    result = run_cli("eval", exports / saver, "--data", text, "--seqlen", SEQLEN, "--json", out)
    assert result.code == 0, result.err
    measured = json.loads(out.read_text(encoding="utf-8"))
    for key in ("tokens", "windows", "text_tokens", "seqlen", "stride"):
        assert evaluation[key] == measured[key], key
    if saver == "gptq_saver":
        assert evaluation["ppl"] == pytest.approx(measured["ppl"], rel=1e-3)
    else:
        assert (evaluation["ppl"], evaluation["nll"]) == (measured["ppl"], measured["nll"])
    assert evaluation["data"] == str(text) and evaluation["max_samples"] is None
    assert evaluation["data_sha256"] == hashlib.sha256(text.read_bytes()).hexdigest()
    assert evaluation["seconds"] > 0


# --- command line ----------------------------------------------------------------------------


def test_cli_prints_and_writes_json(
    run_cli: Callable[..., CliResult], tiny_llama: Path, tmp_path: Path, text: Path
) -> None:
    out = tmp_path / "ppl.json"
    result = run_cli("eval", tiny_llama, "--data", text, "--seqlen", SEQLEN, "--json", out)
    assert result.code == 0, result.err
    data = json.loads(out.read_text(encoding="utf-8"))
    expected = msquant.evaluate_perplexity(tiny_llama, text, seqlen=SEQLEN)
    assert data["ppl"] == expected.ppl and data["tokens"] == expected.tokens
    assert {"nll", "windows", "seconds", "seqlen", "stride", "kind"} <= set(data)
    assert f"perplexity {expected.ppl:.4f}" in result.out and "[float]" in result.out


def test_cli_compare_prints_both_and_the_relative_increase(
    run_cli: Callable[..., CliResult], exports: Path, tied_llama: Path, tmp_path: Path, text: Path
) -> None:
    out = tmp_path / "compare.json"
    quantized = exports / "compressed_tensors"
    args: list[Any] = ["--data", text, "--seqlen", SEQLEN, "--max_samples", 8]
    result = run_cli("eval", "--compare", tied_llama, quantized, *args, "--json", out)
    assert result.code == 0, result.err
    data = json.loads(out.read_text(encoding="utf-8"))
    original = msquant.evaluate_perplexity(tied_llama, text, seqlen=SEQLEN, max_samples=8)
    assert data["original"]["ppl"] == original.ppl
    increase = data["quantized"]["ppl"] / original.ppl - 1
    assert increase != 0
    assert data["relative_increase"] == pytest.approx(increase, rel=1e-12)
    assert data["relative_increase_percent"] == pytest.approx(100 * increase, rel=1e-12)
    lines = result.out.splitlines()
    assert lines[0].startswith("original") and f"ppl {original.ppl:.4f}" in lines[0]
    assert lines[1].startswith("quantized") and "[compressed-tensors]" in lines[1]
    assert f"relative increase {100 * increase:+.3f} %" in lines[2]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["{missing}", "--data", "{data}"], "model folder {missing} does not exist"),
        (["{model}", "--data", "{missing}"], "evaluation data file {missing} does not exist"),
        (["{model}", "--data", "{data}", "--seqlen", "1024"], "max_position_embeddings (512)"),
        (["{model}", "--data", "{one_token}"], "yields 1 token(s); at least 2 are needed"),
        (["{model}", "--data", "{blank}"], "contains no text samples"),
        (["{model}", "--data", "{data}", "--seqlen", "16", "--stride", "32"], "stride must be"),
        (["--data", "{data}"], "pass either MODEL_DIR or --compare"),
        (["{model}", "--compare", "{model}", "{model}", "--data", "{data}"], "exactly one"),
        (["{exports}", "--data", "{data}"], "several savers; evaluate one of them"),
        (["--compare", "{model}", "{missing}", "--data", "{data}"], "{missing} does not exist"),
    ],
)
def test_cli_bad_input_exits_2_with_a_message(
    run_cli: Callable[..., CliResult],
    tiny_llama: Path,
    exports: Path,
    tmp_path: Path,
    text: Path,
    args: list[str],
    message: str,
) -> None:
    (tmp_path / "one.txt").write_text("a", encoding="utf-8")
    (tmp_path / "blank.txt").write_text("\n\n  \n", encoding="utf-8")
    names = {
        "model": tiny_llama,
        "data": text,
        "missing": tmp_path / "nope",
        "one_token": tmp_path / "one.txt",
        "blank": tmp_path / "blank.txt",
        "exports": exports,
    }
    result = run_cli("eval", *(a.format(**names) for a in args))
    assert result.code == 2
    assert message.format(**names) in result.err
    assert "Traceback" not in result.err


def test_float_experts_stored_under_checkpoint_names_are_read_back(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    # MiniMax-M2's checkpoint names its experts block_sparse_moe.experts.N.w1/w2/w3 (the loaded
    # model: mlp.experts.N.gate/down/up_proj); experts left float are stored under those names
    path = tiny_model_factory("minimax_m2", intermediate_size=32)
    config = {
        "apiversion": "modelslim_v1",
        "spec": {
            "process": [
                {
                    "type": "linear_quant",
                    "qconfig": {"weight": INT8_ATTENTION},
                    "exclude": ["*experts*"],
                }
            ],
            "save": [{"type": "ascendv1_saver"}],
        },
    }
    out = tmp_path / "out"
    msquant.quantize(str(path), str(out), config, progress=False)
    back, _ = load_model_for_eval(out, False)
    original = AutoModelForCausalLM.from_pretrained(str(path))
    expert = "model.layers.0.mlp.experts"
    assert torch.equal(back.get_parameter(f"{expert}.0.gate_proj.weight"),
                       original.get_parameter(f"{expert}.gate_up_proj")[0, :32])  # fmt: skip
