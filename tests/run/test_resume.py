"""Checkpoints and ``--resume``: a run killed after layer k continues from layer k + 1 and ends
with the export, byte for byte, and the report (apart from ``*seconds``) of an uninterrupted run.

Kills are simulated by raising ``KeyboardInterrupt`` right after a checkpoint (or in the middle of
the next layer's writes), and once for real: a forked process that ``os._exit``s after layer 0.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import pytest
import torch
from conftest import CALIB_TXT, NEEDS_MOE_TRANSFORMERS, CliResult

import msquant
import msquant.plugin
from msquant import OutputPathError, ResumeError
from msquant.cli import main
from msquant.export.recovery import SavePathLock, make_owned_dir
from msquant.export.shards import WriterStateError, remove_temporaries
from msquant.plugin import DecoderLayer, Processor, ProcessorConfig, RunContext
from msquant.plugin.export import ShardedSafetensorsWriter
from msquant.report.document import strip_timings
from msquant.report.run_report import LayerTiming, ModuleReport, RunReport
from msquant.run.checkpoint.folder import RunCheckpoints
from msquant.run.checkpoint.layout import PROGRESS_FILE, partial_path

SAVERS = [
    {"type": "ascendv1_saver"},
    {"type": "gptq_saver"},
    {"type": "compressed_tensors"},
    {"type": "mindie_format_saver"},
]


def _config(
    method: str = "gptq", runner: str = "layer_wise", group_size: int = 32
) -> dict[str, Any]:
    weight = {
        "dtype": "int4",
        "scope": "per_group",
        "symmetric": False,
        "method": method,
        "ext": {"group_size": group_size},
    }
    entry: dict[str, Any] = {
        "type": "linear_quant",
        "qconfig": {"weight": weight},
        # layer 1 in int8: the layers differ, so a mix-up between them would show
        "dynamic": {r".*\.1\..*": {"bits": 8}},
    }
    if method == "gptq":  # every GPTQ resume also runs the head stage on restored hidden states
        entry["lm_head"] = True
    return {
        "apiversion": "modelslim_v1",
        "spec": {"runner": runner, "process": [entry], "save": SAVERS},
    }


def _quantize(model: Path, save: Path, config: Any, **kwargs: Any) -> msquant.QuantizeResult:
    options = {"calib_path": CALIB_TXT, "max_calib_tokens": 32, "progress": False, **kwargs}
    return msquant.quantize(model, save, config, **options)


def _export(root: Path) -> dict[str, Any]:
    """Every file of an export by relative path: bytes, the report without its timings."""
    files: dict[str, Any] = {}
    for path in sorted(root.rglob("*")):
        if path.is_file():
            name = str(path.relative_to(root))
            if path.name == "quant_report.json":
                files[name] = strip_timings(json.loads(path.read_text()))
            else:
                files[name] = path.read_bytes()
    return files


def _assert_same_export(got: Path, expected: Path) -> None:
    got_files, expected_files = _export(got), _export(expected)
    assert sorted(got_files) == sorted(expected_files)
    assert any(name.endswith(".safetensors") for name in got_files)
    for name, data in expected_files.items():
        assert got_files[name] == data, f"{name} differs from the uninterrupted run's"


@pytest.fixture(scope="module")
def reference(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """The uninterrupted export of a config (run once per config and module)."""
    cache: dict[str, Path] = {}

    def build(config: dict[str, Any], **kwargs: Any) -> Path:
        key = json.dumps([config, kwargs], sort_keys=True, default=str)
        if key not in cache:
            cache[key] = tmp_path_factory.mktemp("reference") / "out"
            _quantize(tiny_llama, cache[key], config, **kwargs)
        return cache[key]

    return build


@contextmanager
def _killed_after(layer_index: int | None) -> Iterator[None]:
    """Interrupt the run right after the checkpoint of ``layer_index`` (None: after the last
    checkpoint, the one taken once every saver finalised)."""
    commit_layer, commit_finished = RunCheckpoints.commit_layer, RunCheckpoints.commit_finished

    def after_layer(self: RunCheckpoints, ctx: RunContext, *args: Any) -> None:
        commit_layer(self, ctx, *args)
        if layer_index is not None and args[1].index == layer_index:
            raise KeyboardInterrupt

    def after_finalize(self: RunCheckpoints, ctx: RunContext) -> None:
        commit_finished(self, ctx)
        raise KeyboardInterrupt

    patch = pytest.MonkeyPatch()
    patch.setattr(RunCheckpoints, "commit_layer", after_layer)
    patch.setattr(RunCheckpoints, "commit_finished", after_finalize)
    try:
        with pytest.raises(KeyboardInterrupt):
            yield
    finally:
        patch.undo()


def _kill(model: Path, save: Path, config: Any, after: int | None = 0, **kwargs: Any) -> None:
    with _killed_after(after):
        _quantize(model, save, config, **kwargs)
    assert (partial_path(save) / PROGRESS_FILE).is_file()


# -- killed and resumed runs --------------------------------------------------------------------


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
@pytest.mark.parametrize("runner", ["layer_wise", "model_wise"])
def test_killed_run_resumes_to_the_uninterrupted_export(
    runner: str,
    device: str,
    tiny_llama: Path,
    tmp_path: Path,
    reference: Callable[..., Path],
) -> None:
    """GPTQ: the hidden states entering layer 1 come from the checkpoint. (minmax runs are
    resumed in the tests below: streamed from a killed process, in memory with --overwrite.)"""
    config = _config("gptq", runner)
    on = {} if device == "cpu" else {"device": device}  # the CPU reference is shared
    save = tmp_path / "out"
    _kill(tiny_llama, save, config, after=0, **on)
    assert not save.exists()  # nothing in place before the run is complete
    progress = json.loads((partial_path(save) / PROGRESS_FILE).read_text())
    assert progress["layers_done"] == 1
    assert [m["name"] for m in progress["report"]["modules"]][0].startswith("model.layers.0.")
    assert progress["ranks"][0]["hidden"]["batches"] >= 1

    result = _quantize(tiny_llama, save, config, resume=True, **on)

    _assert_same_export(save, reference(config, **on))
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # the checkpoint folder is gone
    # the in-memory result holds every quantized module again (weightless when streamed)
    assert len(result.quantized_modules) == 15 and "lm_head" in result.quantized_modules
    assert [m.name for m in result.report.modules] == list(result.quantized_modules)


def test_kill_in_the_middle_of_a_layer_drops_its_half_written_tensors(
    tiny_llama: Path, tmp_path: Path, reference: Callable[..., Path]
) -> None:
    """Killed while the savers write layer 1: their data files hold bytes past the checkpoint,
    which the resumed run truncates before writing layer 1 again."""
    config = _config("gptq", "layer_wise")
    save = tmp_path / "out"
    add = ShardedSafetensorsWriter.add
    seen: list[str] = []

    def add_then_die(self: ShardedSafetensorsWriter, name: str, tensor: torch.Tensor) -> None:
        add(self, name, tensor)
        if name.startswith("model.layers.1."):
            seen.append(name)
            if len(seen) == 9:  # the first saver's layer done, the second's half done
                raise KeyboardInterrupt

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ShardedSafetensorsWriter, "add", add_then_die)
        with pytest.raises(KeyboardInterrupt):
            _quantize(tiny_llama, save, config)
    partial = partial_path(save)
    progress = json.loads((partial / PROGRESS_FILE).read_text())
    assert progress["layers_done"] == 1
    longer = 0
    for entry in progress["ranks"][0]["processors"][1:]:
        writer = entry["state"]["writer"]
        saver_dir = partial / "export" / entry["type"]
        for stream in writer["current"]["streams"].values():
            longer += (saver_dir / stream["file"]).stat().st_size > stream["nbytes"]
    assert longer > 0  # bytes of the half-written layer are on disk

    _quantize(tiny_llama, save, config, resume=True)
    _assert_same_export(save, reference(config))


@pytest.mark.parametrize(
    ("after", "runner", "evaluate"),
    [(1, "layer_wise", False), (None, "model_wise", True)],
    ids=["after-last-layer-streamed", "after-finalize-in-memory-evaluated"],
)
def test_kill_after_the_last_layer_or_the_export_files(
    after: int | None,
    runner: str,
    evaluate: bool,
    tiny_llama: Path,
    tmp_path: Path,
    reference: Callable[..., Path],
) -> None:
    """Resumed after the last layer, the head stage and finalize run again; resumed after
    finalize, the run only checks, evaluates and reports (the perplexity of the rebuilt
    in-memory model is the report's)."""
    config = _config("gptq", runner)
    evaluation: dict[str, Any] = {}
    if evaluate:
        evaluation = {"eval_data": CALIB_TXT, "eval_seqlen": 16, "eval_max_samples": 2}
    save = tmp_path / "out"
    _kill(tiny_llama, save, config, after=after, **evaluation)
    stage = json.loads((partial_path(save) / PROGRESS_FILE).read_text())["stage"]
    assert stage == ("finished" if after is None else "layers")
    if after is None:  # the writers' hidden files are gone, the export files are complete
        assert not list((partial_path(save) / "export").rglob(".*.tmp"))

    result = _quantize(tiny_llama, save, config, resume=True, **evaluation)

    _assert_same_export(save, reference(config, **evaluation))
    assert (result.report.evaluation is not None) == evaluate
    assert "lm_head" in result.quantized_modules
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


@NEEDS_MOE_TRANSFORMERS
def test_moe_run_resumes_with_its_expert_fallbacks(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    """Per-expert linears (GPTQ on the tokens routed to each, a few rounded to nearest for too
    few tokens) are rebuilt from the checkpoint like any linear; the report keeps the experts'
    token counts and fallbacks."""
    model = tiny_model_factory("qwen3_moe", num_layers=2)
    weight = {
        "dtype": "int8",
        "scope": "per_group",
        "symmetric": True,
        "method": "gptq",
        "ext": {"group_size": 32, "expert_min_tokens": 4.0},
    }
    config = {
        "spec": {
            "process": [{"type": "linear_quant", "qconfig": {"weight": weight}}],
            "save": [{"type": "ascendv1_saver"}, {"type": "compressed_tensors"}],
        }
    }
    _quantize(model, tmp_path / "reference", config)
    _kill(model, tmp_path / "out", config, after=0)
    result = _quantize(model, tmp_path / "out", config, resume=True)
    _assert_same_export(tmp_path / "out", tmp_path / "reference")
    experts = [m for m in result.report.modules if ".experts." in m.name]
    assert 0 < sum(1 for m in experts if m.fallback) < len(experts)
    assert all(m.tokens is not None for m in experts)


def _exit_code(pid: int, timeout: float) -> int:
    """The exit code of child ``pid``; killed (and the test failed) if it outlives ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail(f"the child process did not end within {timeout} s")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_process_killed_for_real_resumes_from_the_command_line(
    tiny_llama: Path,
    tmp_path: Path,
    reference: Callable[..., Path],
    run_cli: Callable[..., CliResult],
) -> None:
    """A process that dies on the spot, without any clean-up (a forked child that ``os._exit``s
    right after layer 0's checkpoint), then ``msquant quant ... --resume``."""
    config = _config("minmax", "layer_wise")
    config_path = tmp_path / "config.json"  # JSON is valid YAML
    config_path.write_text(json.dumps(config))
    save = tmp_path / "out"
    args = [
        "quant", "--model_path", tiny_llama, "--save_path", save, "--config_path", config_path,
        "--calib_path", CALIB_TXT, "--max_calib_tokens", "32", "--no_progress",
    ]  # fmt: skip
    pid = os.fork()  # a child process with everything imported already (a new one takes seconds)
    if pid == 0:
        try:
            commit = RunCheckpoints.commit_layer

            def die(self: RunCheckpoints, *rest: Any) -> None:
                commit(self, *rest)
                os._exit(9)

            RunCheckpoints.commit_layer = die  # type: ignore[method-assign]
            main([str(a) for a in args])
        finally:
            os._exit(1)  # never back into pytest
    assert _exit_code(pid, timeout=120) == 9
    assert not save.exists()
    refused = run_cli(*args)  # the same command without --resume does not drop the work
    assert refused.code == 2
    assert "--resume" in refused.err and "1 of 2 decoder layers done" in refused.err

    resumed = run_cli(*args, "--resume")

    assert resumed.code == 0, resumed.err
    expected, got = _export(reference(config)), _export(save)
    assert sorted(got) == sorted(expected)
    for name, data in expected.items():
        # the config copy holds the config file's text here, the mapping dumped as YAML there
        # (and the marker lists that file's checksum)
        if not name.endswith(("best_practice.yaml", "msquant_export.json")):
            assert got[name] == data, name
    assert [p.name for p in sorted(tmp_path.iterdir())] == ["config.json", "out"]


# -- what cannot be resumed ---------------------------------------------------------------------


def test_resume_with_other_inputs_is_refused_naming_them(
    tiny_llama: Path, tmp_path: Path, run_cli: Callable[..., CliResult]
) -> None:
    save = tmp_path / "out"
    _kill(tiny_llama, save, _config("gptq"), after=0)

    with pytest.raises(ResumeError, match=r"other inputs[\s\S]*config \(sha256"):
        _quantize(tiny_llama, save, _config("gptq", group_size=64), resume=True)
    with pytest.raises(ResumeError, match=r"calibration data") as error:
        _quantize(tiny_llama, save, _config("gptq"), resume=True, max_calib_tokens=16)
    assert "config" not in str(error.value).split("other inputs")[1].split("\n")[1]
    assert (partial_path(save) / PROGRESS_FILE).is_file()  # a refusal keeps the work

    config_path = tmp_path / "other.json"
    config_path.write_text(json.dumps(_config("minmax")))
    result = run_cli(
        "quant", "--model_path", tiny_llama, "--save_path", save, "--config_path", config_path,
        "--calib_path", CALIB_TXT, "--max_calib_tokens", "32", "--no_progress", "--resume",
    )  # fmt: skip
    assert result.code == 2
    assert "was started with other inputs" in result.err and "config" in result.err


def test_resume_without_an_interrupted_run_is_an_input_error(
    tiny_llama: Path, tmp_path: Path, run_cli: Callable[..., CliResult]
) -> None:
    with pytest.raises(ResumeError, match="no interrupted run of .* to resume"):
        _quantize(tiny_llama, tmp_path / "out", _config("minmax"), resume=True)
    result = run_cli(
        "quant", "--model_path", tiny_llama, "--save_path", tmp_path / "out",
        "--quant_type", "w8a16", "--resume", "--no_progress",
    )  # fmt: skip
    assert result.code == 2 and "no interrupted run" in result.err
    assert list(tmp_path.iterdir()) == []


def test_new_run_is_refused_while_an_interrupted_one_is_kept_unless_overwrite(
    tiny_llama: Path, tmp_path: Path, reference: Callable[..., Path]
) -> None:
    config = _config("minmax")
    save = tmp_path / "out"
    _kill(tiny_llama, save, config, after=0)
    with pytest.raises(ResumeError, match=r"add --resume .* or --overwrite to start over"):
        _quantize(tiny_llama, save, _config("minmax", group_size=64))
    _quantize(tiny_llama, save, config, overwrite=True)  # discards it and starts over
    _assert_same_export(save, reference(config))
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_nothing_to_keep_before_the_first_checkpoint(
    tiny_llama: Path, tmp_path: Path, reference: Callable[..., Path]
) -> None:
    """Stopped before layer 0's checkpoint, a run leaves nothing; a folder such a run left
    behind anyway (killed for real) resumes from the first layer, its files ignored."""
    config = _config("minmax", "model_wise")
    save = tmp_path / "out"

    def interrupt(*_: Any) -> None:
        raise KeyboardInterrupt

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(RunCheckpoints, "keep_layer", interrupt)
        with pytest.raises(KeyboardInterrupt):
            _quantize(tiny_llama, save, config)
    assert list(tmp_path.iterdir()) == []

    make_owned_dir(partial_path(save), "checkpoints")  # as the killed run created it
    stale = partial_path(save) / "export" / "ascendv1_saver"
    stale.mkdir(parents=True)
    (stale / "half_written.safetensors").write_bytes(b"junk")
    _quantize(tiny_llama, save, config, resume=True)
    _assert_same_export(save, reference(config))


def test_damaged_progress_file_is_a_clear_error(tiny_llama: Path, tmp_path: Path) -> None:
    save = tmp_path / "out"
    _kill(tiny_llama, save, _config("minmax"), after=0)
    progress = partial_path(save) / PROGRESS_FILE
    progress.write_bytes(progress.read_bytes()[:100])  # as if half written
    with pytest.raises(ResumeError, match=r"progress file .* is unreadable .* --overwrite"):
        _quantize(tiny_llama, save, _config("minmax"), resume=True)


def test_damaged_writer_files_are_a_clear_error(tiny_llama: Path, tmp_path: Path) -> None:
    save = tmp_path / "out"
    _kill(tiny_llama, save, _config("minmax"), after=0)
    export = partial_path(save) / "export" / "gptq_saver"
    for data_file in export.glob(".*.data*.tmp"):
        data_file.write_bytes(b"")
    before = _export(partial_path(save))
    with pytest.raises(ResumeError, match=r"gptq_saver cannot take up its checkpoint .* bytes"):
        _quantize(tiny_llama, save, _config("minmax"), resume=True)
    assert _export(partial_path(save)) == before  # refused, nothing changed: as the message says
    _quantize(tiny_llama, save, _config("minmax"), overwrite=True)  # which discards it
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_a_failed_run_leaves_nothing_behind(tiny_llama: Path, tmp_path: Path) -> None:
    """An exception after a checkpoint removes the checkpoints too (a failed run never leaves
    files behind); only an interruption keeps them."""
    commit = RunCheckpoints.commit_layer

    def fail(self: RunCheckpoints, ctx: RunContext, *args: Any) -> None:
        commit(self, ctx, *args)
        assert (self.directory / PROGRESS_FILE).is_file()
        raise RuntimeError("device lost")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(RunCheckpoints, "commit_layer", fail)
        with pytest.raises(RuntimeError, match="device lost"):
            _quantize(tiny_llama, tmp_path / "out", _config("minmax"))
    assert list(tmp_path.iterdir()) == []


def test_overwrite_keeps_the_previous_export_until_the_resumed_run_ends(
    tiny_llama: Path, tmp_path: Path, reference: Callable[..., Path]
) -> None:
    save = tmp_path / "out"
    _quantize(tiny_llama, save, _config("minmax", group_size=64))
    before = _export(save)
    config = _config("minmax", "model_wise")
    _kill(tiny_llama, save, config, after=0, overwrite=True)
    assert _export(save) == before
    _quantize(tiny_llama, save, config, overwrite=True, resume=True)
    _assert_same_export(save, reference(config))


class _StatefulConfig(ProcessorConfig):
    type: Literal["test_stateful"] = "test_stateful"


class _Stateful(Processor):
    """A processor that does not declare itself resumable."""

    type_name = "test_stateful"
    config_class = _StatefulConfig

    def after_layer(self, ctx: RunContext, layer: DecoderLayer) -> None:
        if layer.index == 1:
            raise KeyboardInterrupt


def test_a_processor_that_is_not_resumable_turns_checkpoints_off(
    tiny_llama: Path, tmp_path: Path
) -> None:
    registry = msquant.plugin.default_registry()
    registry.register(_Stateful)
    config = _config("minmax")
    config["spec"]["process"].append({"type": "test_stateful"})
    save = tmp_path / "out"
    _kill(tiny_llama, save, _config("minmax"), after=0)  # an earlier, checkpointed run
    with pytest.raises(ResumeError, match="test_stateful cannot be resumed"):
        _quantize(tiny_llama, save, config, registry=registry, resume=True)
    with pytest.raises(KeyboardInterrupt):  # --overwrite discards the earlier run's work
        _quantize(tiny_llama, save, config, registry=registry, overwrite=True)
    assert list(tmp_path.iterdir()) == []  # nothing checkpointed, nothing left


def test_two_runs_cannot_share_a_checkpoint_folder(tiny_llama: Path, tmp_path: Path) -> None:
    """The save path's lock is held by every run, from before its checkpoint folder is touched."""
    save = tmp_path / "out"
    _kill(tiny_llama, save, _config("minmax"), after=0)
    before = _export(partial_path(save))
    with SavePathLock(save):  # another run holds the save path
        with pytest.raises(OutputPathError, match="another msquant run is writing to"):
            _quantize(tiny_llama, save, _config("minmax"), resume=True)
    assert _export(partial_path(save)) == before


# -- the pieces ---------------------------------------------------------------------------------


def _tensors(count: int) -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    dtypes = [torch.float32, torch.int8, torch.bfloat16, torch.int32]
    return [
        (f"t{i:02d}", torch.randn(3 + i, 5, generator=generator).to(dtypes[i % 4]))
        for i in range(count)
    ]


def _writer_output(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


@pytest.mark.parametrize("kill_while_closing", [False, True])
def test_writer_restored_from_a_state_writes_the_uninterrupted_files(
    kill_while_closing: bool, tmp_path: Path
) -> None:
    """Shards of ~3 tensors: the state is taken mid-shard, the killed writer goes on through a
    shard flush (and, in one case, through close), then a new writer restores the state."""
    tensors = _tensors(12)
    plain = ShardedSafetensorsWriter(tmp_path / "plain", "w", 300)
    (tmp_path / "plain").mkdir()
    for name, tensor in tensors:
        plain.add(name, tensor)
    plain.close()

    directory = tmp_path / "resumed"
    directory.mkdir()
    killed = ShardedSafetensorsWriter(directory, "w", 300)
    for name, tensor in tensors[:5]:
        killed.add(name, tensor)
    state = json.loads(json.dumps(killed.state()))  # as a checkpoint stores it
    assert state["shards"] and state["current"]["entries"]
    for name, tensor in tensors[5:] if kill_while_closing else tensors[5:9]:
        killed.add(name, tensor)
    if kill_while_closing:
        killed.close()  # the final files exist, the hidden ones the state names too
    del killed

    resumed = ShardedSafetensorsWriter(directory, "w", 300)
    resumed.restore(state)
    for name, tensor in tensors[5:]:
        resumed.add(name, tensor)
    resumed.close()
    assert remove_temporaries(directory) > 0
    assert _writer_output(directory) == _writer_output(tmp_path / "plain")


def test_writer_state_must_match_the_files(tmp_path: Path) -> None:
    writer = ShardedSafetensorsWriter(tmp_path, "w", 300)
    for name, tensor in _tensors(5):
        writer.add(name, tensor)
    state = writer.state()
    with pytest.raises(WriterStateError, match="prefix 'w', not 'x'"):
        ShardedSafetensorsWriter(tmp_path, "x", 300).restore(state)
    shard = tmp_path / state["shards"][0]["file"]
    shard.write_bytes(shard.read_bytes()[:-1])
    with pytest.raises(WriterStateError, match=r"holds \d+ bytes, the checkpoint recorded"):
        ShardedSafetensorsWriter(tmp_path, "w", 300).restore(state)
    shard.unlink()
    with pytest.raises(WriterStateError, match="is missing"):
        ShardedSafetensorsWriter(tmp_path, "w", 300).restore(state)


def test_report_records_round_trip_exactly() -> None:
    report = RunReport(model_path="m")
    report.add_module(ModuleReport("a", "gptq", 4, 32, False, gptq_loss=float("nan"), percdamp=0.1))
    report.add_module(ModuleReport("b", "minmax", 8, None, True))
    report.add_layer(LayerTiming(0, "model.layers.0", 1.25))
    records = json.loads(json.dumps(report.layer_records()))
    restored = RunReport()
    restored.restore_layer_records(records)
    assert restored.layers == report.layers
    assert restored.modules[1] == report.modules[1]
    assert str(restored.modules[0].gptq_loss) == "nan" and restored.modules[0].percdamp == 0.1
    assert restored.model_path == ""  # run-wide fields are the resumed run's own
    with pytest.raises(ValueError, match="no list field 'model_path'"):
        restored.restore_layer_records({"model_path": []})
