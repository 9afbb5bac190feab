"""Red-team replays, round 3 (issue 24): inputs that hung a run, signals that did not say the
work was lost, tracebacks for bad input, configs that quantized nothing and exited 0, and
errors that blamed the wrong module. Plugins are in ``test_rt_plugins.py``."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from replay import CALIB_TXT, Cli, needs_fork, on_entry, quant_args, replay, run_forked
from safetensors.torch import load_file, save_file

from msquant.errors import QuantizationError
from msquant.load.streaming import StreamedWeights
from msquant.processors.linear_quant.act import StaticActCalibration
from msquant.run.checkpoint.folder import RunCheckpoints
from msquant.run.checkpoint.layout import PROGRESS_FILE, partial_path

ROOT = Path(__file__).resolve().parents[2]

HEADER = "apiversion: modelslim_v1\nspec:\n"
LINEAR = """\
    - type: linear_quant
      qconfig:
        weight: {{dtype: int8, scope: per_channel, symmetric: true, method: {method}}}
"""
STATIC = """\
    - type: linear_quant
      qconfig:
        act: {dtype: int8, scope: per_tensor, symmetric: false, method: minmax}
        weight: {dtype: int8, scope: per_channel, symmetric: true, method: minmax}
"""


def _config(root: Path, name: str, text: str) -> str:
    (root / name).write_text(text, encoding="utf-8")
    return name


def _calibrated(root: Path, config: str, *extra: object) -> list[object]:
    """``quant`` with the test calibration set, 32 tokens a sample."""
    return quant_args(
        root, "--calib_path", CALIB_TXT, "--max_calib_tokens", "32", *extra, config=config
    )


# -- numeric fields that set a search size or a count: bounded, refused by validate ---------------


@pytest.mark.parametrize(
    ("weight", "field", "bound"),
    [
        ("method: minmax, ext: {mse: true, mse_grid: 1000000000}", "mse_grid", 1000),
        ("method: gptq, ext: {mse: true, mse_grid: 1000000000}", "mse_grid", 1000),
        ("method: hessian_clip, ext: {clip_grid: 1000000000}", "clip_grid", 1000),
        ("method: ssz, ext: {step: 1000000000}", "step", 1000),
        ("method: gptq, ext: {max_damp_retries: 1000000000}", "max_damp_retries", 100),
    ],
    ids=["minmax_mse_grid", "gptq_mse_grid", "hessian_clip_grid", "ssz_step", "gptq_retries"],
)
def test_a_search_size_beyond_its_bound_is_refused_by_validate(
    case: Path, run_cli: Cli, weight: str, field: str, bound: int
) -> None:
    """``clip_grid: 1000000000`` and ``mse_grid: 1000000000`` validated as fine, then spun."""
    config = _config(
        case,
        "grid.yaml",
        HEADER + "  process:\n    - type: linear_quant\n      qconfig:\n        weight: "
        f"{{dtype: int8, scope: per_channel, symmetric: true, {weight}}}\n",
    )
    pattern = (
        rf"spec.process\[0\].qconfig.weight.ext.{field}: Input should be less than or equal to "
        rf"{bound}, got 1000000000"
    )
    replay(run_cli, case, "validate", case / config).invalid(pattern)
    started = time.monotonic()
    replay(run_cli, case, *_calibrated(case, config)).refused(pattern)
    assert time.monotonic() - started < 30


def test_the_bounds_are_in_the_schema(run_cli: Cli) -> None:
    schema = run_cli("schema")
    assert schema.code == 0
    text = json.loads(schema.out)
    found = json.dumps(text)
    for field, bound in (("mse_grid", 1000), ("clip_grid", 1000), ("max_damp_retries", 100)):
        assert re.search(rf'"{field}": \{{[^}}]*"maximum": {bound}', found), field


def test_prior_stages_are_counted(case: Path, run_cli: Cli) -> None:
    """Each prior stage is a calibration flow through every layer and a copy of the weights."""
    stages = "".join("    - process: []\n" for _ in range(9))
    config = _config(case, "prior9.yaml", HEADER + "  prior:\n" + stages + "  process: []\n")
    replay(run_cli, case, "validate", case / config).invalid(
        r"spec.prior: List should have at most 8 items after validation, not 9"
    )


def test_numeric_flags_are_bounded(case: Path, run_cli: Cli) -> None:
    """``schema --indent 1000000000`` printed gigabytes of spaces; ``--nproc`` had no bound."""
    with pytest.raises(SystemExit) as usage:  # argparse's usage error
        run_cli("schema", "--indent", "1000000000")
    assert usage.value.code == 2
    most = max(8, 4 * (os.cpu_count() or 1))
    replay(run_cli, case, *quant_args(case, "--nproc", "1000000")).refused(
        rf"--nproc 1000000: at most {most} processes on this machine \(4 per CPU core"
    )


# -- one calibration sample of millions of tokens ------------------------------------------------


def test_an_over_long_calibration_sample_is_refused_before_loading(
    case: Path, run_cli: Cli
) -> None:
    """A .txt file without blank lines is one sample: 200 000 tokens went through attention
    whole (quadratic: hours); it is refused, saying the limit and how to change it."""
    words = CALIB_TXT.read_text(encoding="utf-8").split()
    text = case / "book.txt"
    text.write_text(" ".join(words[i % len(words)] for i in range(200_000)) + "\n")
    args = quant_args(case, "--calib_path", text, config="gptq.yaml")
    del args[args.index("--max_calib_tokens") : args.index("--max_calib_tokens") + 2]
    started = time.monotonic()
    replay(run_cli, case, *args).refused(
        r"calibration sample 1 of 1 has \d+ tokens, more than the 65536 a sample may have whole "
        r"\(the larger of 65536, the model's max_position_embeddings 512\).*Split the text into "
        r"shorter samples.*pass --max_calib_tokens N"
    )
    assert time.monotonic() - started < 60
    truncated = replay(run_cli, case, *args, "--max_calib_tokens", "64")
    assert truncated.code == 0, truncated.err


# -- SIGTERM: the message tells what became of the work ------------------------------------------


def _terminated_at_layer_1() -> None:
    on_entry(StreamedWeights.materialize, lambda: signal.raise_signal(signal.SIGTERM), call=2)


@needs_fork
def test_sigterm_of_a_run_without_checkpoints_says_the_work_is_lost(case: Path) -> None:
    log = case.parent / "run.log"
    code = run_forked(quant_args(case, "--no_checkpoints"), log, _terminated_at_layer_1)
    assert code == 143
    text = log.read_text()
    assert (
        "msquant: terminated (SIGTERM); nothing was written to the save path; the work done is "
        "lost (this run writes no checkpoints: checkpoints are turned off (--no_checkpoints; "
        "Python: checkpoints=False)); run the same command again to start over"
    ) in text
    assert "--resume" not in text


@needs_fork
def test_sigterm_of_a_smoothing_run_tells_the_truth(case: Path) -> None:
    """``iter_smooth`` runs could not be resumed and SIGTERM did not say the work was lost. The
    message follows what the run kept: smoothing is resumable now, so the hint to resume, which
    then finishes the run."""
    config = _config(case, "smooth.yaml", HEADER + "  process:\n    - type: iter_smooth\n" + STATIC)
    log = case.parent / "run.log"
    terminate = lambda: on_entry(  # noqa: E731  (in layer 1: layer 0's checkpoint is taken)
        RunCheckpoints.commit_layer, lambda: signal.raise_signal(signal.SIGTERM), call=2
    )
    code = run_forked(_calibrated(case, config), log, terminate)
    assert code == 143
    text = log.read_text()
    line = text[text.index("msquant: terminated (SIGTERM)") :]
    assert (partial_path(case / "out") / PROGRESS_FILE).is_file()
    assert "(1 of 2 decoder layers done) is kept in" in line
    assert "run the same command with --resume" in line
    assert run_forked([*_calibrated(case, config), "--resume"], log, lambda: None) == 0
    assert (case / "out" / "msquant_export.json").is_file()


@needs_fork
def test_sigterm_before_the_first_checkpoint_says_nothing_was_kept(case: Path) -> None:
    log = case.parent / "run.log"
    terminate = lambda: on_entry(  # noqa: E731
        StreamedWeights.materialize, lambda: signal.raise_signal(signal.SIGTERM), call=1
    )
    assert run_forked(quant_args(case), log, terminate) == 143
    assert (
        "the work done is lost (no decoder layer had finished, so there was no checkpoint to "
        "keep); run the same command again to start over"
    ) in log.read_text()
    assert not partial_path(case / "out").exists()


# -- a rank of --nproc 2 killed ------------------------------------------------------------------


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def _ranks(launcher: int) -> list[int]:
    """The spawned processes of a group, in start order (rank order)."""
    found = []
    for child in _children(launcher):
        try:
            if "spawn_main" in Path(f"/proc/{child}/cmdline").read_text():
                found.append(child)
        except OSError:
            continue
    return sorted(found)


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux /proc")
def test_a_killed_rank_is_named_with_a_meaningful_exit_code(
    tmp_path: Path, tiny_model_factory: Callable[..., Path]
) -> None:
    """Killing one process of ``--nproc 2`` ended the launcher with exit 247 (-9 & 0xff) and no
    message; it now names the process, the signal and the way on, and exits 128 + 9."""
    model = tiny_model_factory("llama", num_layers=6, hidden_size=128, intermediate_size=256)
    config = tmp_path / "gptq.yaml"
    config.write_text(HEADER + "  process:\n" + LINEAR.format(method="gptq"), encoding="utf-8")
    save = tmp_path / "out"
    command = [
        sys.executable, "-m", "msquant", "quant", "--model_path", str(model),
        "--save_path", str(save), "--config_path", str(config), "--calib_path", str(CALIB_TXT),
        "--nproc", "2", "--no_progress",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    launcher = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=env)
    progress = partial_path(save) / PROGRESS_FILE
    deadline = time.monotonic() + 240
    try:
        while not progress.is_file() and launcher.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        ranks = _ranks(launcher.pid)
        assert progress.is_file() and len(ranks) == 2, "the group did not reach a checkpoint"
        os.kill(ranks[1], signal.SIGKILL)
        _, err = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert launcher.returncode == 137, err
    assert "Traceback" not in err
    assert re.search(
        r"msquant: error: process 1 of the 2 of the dp_layer_wise group \(device cpu, pid "
        rf"{ranks[1]}\) was killed by SIGKILL .*nothing was written to the save path; the "
        r"finished work \(\d+ of 6 decoder layers done\) is kept in .*: run the same command "
        r"with --resume",
        err,
    ), err
    assert not save.exists()


# -- tracebacks for bad input --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        (
            "nul.jsonl",
            '{"text": "the quick\\u0000 fox"}\n',
            r"nul.jsonl line 1: holds a NUL character \(U\+0000\) at character 10",
        ),
        ("nul.txt", "first sample\n\nthe\x00 fox\n", r"nul.txt line 3: holds a NUL character"),
        (
            "surrogate.jsonl",
            '{"text": "fine"}\n{"text": "half \\ud83d of a pair"}\n',
            r"surrogate.jsonl line 2: holds a lone surrogate \(U\+D83D\) at character 6, which "
            r"is not valid Unicode",
        ),
    ],
    ids=["nul_jsonl", "nul_txt", "lone_surrogate"],
)
def test_a_calibration_line_that_is_not_text_is_named(
    case: Path, run_cli: Cli, name: str, content: str, message: str
) -> None:
    """A lone surrogate was a TypeError traceback from the tokenizer; a NUL was taken as text."""
    (case / name).write_text(content, encoding="utf-8", errors="surrogatepass")
    args = quant_args(case, "--calib_path", case / name, config="gptq.yaml")
    args[args.index("--calib_path") + 1] = case / name
    replay(run_cli, case, *args).refused(message)


def test_heads_that_do_not_divide_the_hidden_size_are_an_input_error(
    case: Path, run_cli: Cli
) -> None:
    """transformers' validation error escaped as an internal error (exit 1, traceback)."""
    path = case / "model" / "config.json"
    data = json.loads(path.read_text())
    data["num_attention_heads"] = data["num_key_value_heads"] = 3
    path.write_text(json.dumps(data))
    replay(run_cli, case, *quant_args(case)).refused(
        r"cannot read the model config in .*The hidden size \(64\) is not a multiple of the "
        r"number of attention heads \(3\)"
    )
    del data["head_dim"]
    path.write_text(json.dumps(data))
    replay(run_cli, case, *quant_args(case)).refused(
        r"config.json in .* says hidden_size 64 and num_attention_heads 3, which does not divide"
    )
    data["num_attention_heads"], data["num_key_value_heads"] = 4, 3
    path.write_text(json.dumps(data))
    replay(run_cli, case, *quant_args(case)).refused(
        r"says num_attention_heads 4 and num_key_value_heads 3, which does not divide it"
    )


# -- a save path inside the model folder through a symbolic link ----------------------------------


def test_a_save_path_inside_the_model_folder_through_a_link_is_refused(
    case: Path, run_cli: Cli
) -> None:
    """``model/ext/out`` with ``ext`` a link out of the model folder was accepted."""
    (case / "elsewhere").mkdir()
    (case / "model" / "ext").symlink_to(case / "elsewhere")
    replay(run_cli, case, *quant_args(case, "--save_path", case / "model" / "ext" / "out")).refused(
        rf"save path {re.escape(str(case / 'model' / 'ext' / 'out'))} lies inside the model "
        rf"folder {re.escape(str(case / 'model'))}"
    )


# -- configs that quantize nothing ---------------------------------------------------------------


@pytest.mark.parametrize("transform", ["iter_smooth", "quarot"])
def test_a_transform_only_config_is_refused_unless_a_float_export_is_asked(
    case: Path, run_cli: Cli, transform: str
) -> None:
    """A smoothing-only config exited 0 having quantized nothing."""
    config = _config(case, "only.yaml", HEADER + f"  process:\n    - type: {transform}\n")
    replay(run_cli, case, *_calibrated(case, config)).refused(
        rf"spec.process transforms the weights \({transform}\) but has no entry that quantizes "
        r"linear layers.*pass --allow_float_export"
    )
    asked = replay(run_cli, case, *_calibrated(case, config, "--allow_float_export"))
    assert asked.code == 0, asked.err
    report = json.loads((case / "out" / "quant_report.json").read_text())
    assert report["modules"] == []


def test_y34_an_empty_process_list_is_refused_the_same_way(case: Path, run_cli: Cli) -> None:
    """Round 1's Y34 (``spec.process: []`` exited 0), refused since issue 13: the same rule."""
    config = _config(case, "empty.yaml", HEADER + "  process: []\n")
    replay(run_cli, case, *quant_args(case, config=config)).refused(
        r"spec.process has no entry that quantizes linear layers.*pass --allow_float_export"
    )


def test_linear_quant_in_a_prior_stage_is_refused(case: Path, run_cli: Cli) -> None:
    """``linear_quant`` in spec.prior and spec.process wrote a report with 0 modules."""
    entry = LINEAR.format(method="minmax")
    prior = "".join("  " + line + "\n" for line in entry.splitlines())
    config = _config(
        case, "prior.yaml", HEADER + "  prior:\n    - process:\n" + prior + "  process:\n" + entry
    )
    replay(run_cli, case, *quant_args(case, config=config)).refused(
        r"spec.prior\[0\]: linear_quant would quantize 14 linear layer\(s\) "
        r"\(model.layers.0.self_attn.q_proj, .* and 11 more\) in a prior stage.*move the entry "
        r"into spec.process"
    )


def test_w8a8_static_on_one_token_warns(case: Path, run_cli: Cli) -> None:
    config = _config(case, "static.yaml", HEADER + "  process:\n" + STATIC)
    one = case / "one.jsonl"
    one.write_text('{"text": "the"}\n')
    outcome = replay(run_cli, case, *quant_args(case, "--calib_path", one, config=config))
    assert outcome.code == 0, outcome.err
    assert re.search(
        r"calibration: 1 sample\(s\) with \d token\(s\) in all, fewer than 512: what the run "
        r"measures on them \(static activation ranges",
        outcome.err,
    )


# -- a huge weight is blamed on the module that holds it -----------------------------------------


@pytest.mark.parametrize("config", ["gptq", "static", "minmax"])
def test_a_huge_weight_is_named_where_it_is(case: Path, run_cli: Cli, config: str) -> None:
    """A 3e38 weight in up_proj was blamed on down_proj's calibration inputs (GPTQ), crashed
    with a traceback (W8A8 static) or was quantized (minmax)."""
    path = case / "model" / "model.safetensors"
    weights = load_file(path)
    weights["model.layers.0.mlp.up_proj.weight"][3, 5] = 3e38
    save_file(weights, path, metadata={"format": "pt"})
    text = STATIC if config == "static" else LINEAR.format(method=config)
    name = _config(case, f"{config}.yaml", HEADER + "  process:\n" + text)
    replay(run_cli, case, *_calibrated(case, name)).refused(
        r"model.layers.0.mlp.up_proj.weight: the checkpoint's tensor \(128, 64\) holds 1 "
        r"value\(s\) larger than 2\^64 in magnitude \(the largest 3e\+38\)"
    )


def test_static_calibration_names_the_module_whose_inputs_are_not_finite() -> None:
    """Found beside the cases above: NaN/Inf activations reaching a W8A8 static linear ended in
    ``ValueError: cannot convert float NaN to integer`` (exit 1)."""
    calibration = StaticActCalibration(symmetric=False)
    linear = torch.nn.Linear(4, 3)
    calibration.hook("model.layers.0.mlp.down_proj", linear, linear.weight.detach().clone())
    linear(torch.ones(2, 4))
    with pytest.raises(QuantizationError, match=r"model.layers.0.mlp.down_proj: its calibration"):
        linear(torch.tensor([[1.0, float("inf"), 0.0, 1.0]]))
