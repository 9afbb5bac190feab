"""Checkpoints and ``--resume`` of ``dp_layer_wise`` groups: each process writes its share of the
hidden states beside process 0's checkpoint, a killed group resumes with as many processes to the
export (byte for byte) and report (apart from ``*seconds``) of an uninterrupted group, and the
uninterrupted group still writes the single-process export.

The groups are forked from the test process (2 gloo processes, everything imported already: a
spawned process would take seconds to start); a process is killed for real, ``os._exit`` right
after the checkpoint of a given layer, without any clean-up.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
from conftest import CALIB_TXT
from run.test_resume import _assert_same_export, _export

import msquant
from msquant import ResumeError
from msquant.cli import main
from msquant.plugin import RunContext
from msquant.run.checkpoint.folder import RunCheckpoints
from msquant.run.checkpoint.layout import PROGRESS_FILE, partial_path

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")

KILLED = 9  # the exit code of a process killed after a checkpoint


def _config() -> dict[str, Any]:
    weight = {
        "dtype": "int4",
        "scope": "per_group",
        "symmetric": False,
        "method": "gptq",
        "ext": {"group_size": 32},
    }
    entry = {
        "type": "linear_quant",
        "qconfig": {"weight": weight},
        "dynamic": {r".*\.1\..*": {"bits": 8}},  # the layers differ: a mix-up would show
        "lm_head": True,  # the head stage runs on the restored hidden states too
    }
    save = [{"type": "ascendv1_saver"}, {"type": "gptq_saver"}]
    return {
        "apiversion": "modelslim_v1",
        "spec": {"runner": "dp_layer_wise", "process": [entry], "save": save},
    }


@pytest.fixture(scope="module")
def model(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory("llama", num_layers=3)


@pytest.fixture(scope="module")
def config_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("config") / "config.json"  # JSON is valid YAML
    path.write_text(json.dumps(_config()))
    return path


def _args(model: Path, save: Path, config_path: Path, *extra: str) -> list[str]:
    return [
        "quant", "--model_path", str(model), "--save_path", str(save),
        "--config_path", str(config_path), "--calib_path", str(CALIB_TXT),
        "--max_calib_tokens", "24", "--no_progress", *extra,
    ]  # fmt: skip


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _die_after(layer_index: int | None) -> None:
    """Make this (forked) process exit on the spot right after layer ``layer_index``'s
    checkpoint (None: the last one, once the savers finalised): no clean-up, no ``finally``, as
    a killed process."""
    commit, commit_finished = RunCheckpoints.commit_layer, RunCheckpoints.commit_finished

    def die() -> None:
        sys.stderr.flush()
        os._exit(KILLED)

    def commit_then_die(self: RunCheckpoints, ctx: RunContext, *rest: Any) -> None:
        commit(self, ctx, *rest)
        if rest[1].index == layer_index:
            die()

    def finish_then_die(self: RunCheckpoints, ctx: RunContext) -> None:
        commit_finished(self, ctx)
        if layer_index is None:
            die()

    RunCheckpoints.commit_layer = commit_then_die  # type: ignore[method-assign]
    RunCheckpoints.commit_finished = finish_then_die  # type: ignore[method-assign]


def _run_group(
    args: list[str], world_size: int = 2, die_after: Mapping[int, int | None] | None = None
) -> list[int]:
    """Run ``msquant ARGS`` as a ``dp_layer_wise`` group of forked processes, as torchrun would
    start them (``RANK``, ``WORLD_SIZE``, ``MASTER_*``); returns their exit codes by rank.

    :param die_after: rank -> the layer after whose checkpoint that process is killed.
    """
    port = str(_free_port())
    pids = []
    for rank in range(world_size):
        pid = os.fork()
        if pid == 0:  # the child: never back into pytest
            code = 1
            try:
                os.environ.update(
                    RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                    MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                )  # fmt: skip
                if die_after and rank in die_after:
                    _die_after(die_after[rank])
                code = main(args)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        pids.append(pid)
    return _exit_codes(pids, timeout=120)


def _exit_codes(pids: list[int], timeout: float) -> list[int]:
    """The exit codes of child processes ``pids``; all killed (and the test failed) if one
    outlives ``timeout`` (a process waiting forever on a dead peer would show here)."""
    deadline = time.monotonic() + timeout
    codes: dict[int, int] = {}
    while len(codes) < len(pids) and time.monotonic() < deadline:
        for pid in pids:
            if pid not in codes:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[pid] = os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    if len(codes) < len(pids):
        for pid in set(pids) - set(codes):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        pytest.fail(f"a process of the group did not end within {timeout} s")
    return [codes[pid] for pid in pids]


def _progress(save: Path) -> dict[str, Any]:
    return dict(json.loads((partial_path(save) / PROGRESS_FILE).read_text()))


@pytest.fixture(scope="module")
def uninterrupted(model: Path, config_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The export of an uninterrupted, checkpointed 2-process group."""
    save = tmp_path_factory.mktemp("uninterrupted") / "out"
    assert _run_group(_args(model, save, config_path)) == [0, 0]
    return save


@pytest.fixture(scope="module")
def killed(model: Path, config_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The save path of a 2-process group whose processes were both killed after layer 0's
    checkpoint (tests copy its checkpoint folder)."""
    save = tmp_path_factory.mktemp("killed") / "out"
    codes = _run_group(_args(model, save, config_path), die_after={0: 0, 1: 0})
    assert codes == [KILLED, KILLED]
    assert not save.exists()
    return save


def _copy_checkpoint(source: Path, save: Path) -> None:
    shutil.copytree(partial_path(source), partial_path(save))


def test_checkpointed_group_writes_the_single_process_export(
    model: Path, config_path: Path, uninterrupted: Path, tmp_path: Path
) -> None:
    single = tmp_path / "single"
    msquant.quantize(
        model, single, config_path, calib_path=CALIB_TXT, max_calib_tokens=24, progress=False
    )
    got, expected = _export(uninterrupted), _export(single)
    assert sorted(got) == sorted(expected)
    for name, data in expected.items():
        if name != "quant_report.json":  # the Hessians are summed in another order
            assert got[name] == data, name
    assert [p.name for p in uninterrupted.parent.iterdir()] == ["out"]  # checkpoints removed


def test_killed_group_resumes_to_the_uninterrupted_export(
    model: Path, config_path: Path, killed: Path, uninterrupted: Path, tmp_path: Path
) -> None:
    progress = _progress(killed)
    assert progress["layers_done"] == 1 and progress["fingerprint"]["world_size"] == 2
    assert [entry["hidden"]["file"] for entry in progress["ranks"]] == [
        "hidden-00001-rank0.safetensors",
        "hidden-00001-rank1.safetensors",
    ]
    # each process holds its own share: the files differ, process 1 runs no saver
    files = [partial_path(killed) / e["hidden"]["file"] for e in progress["ranks"]]
    assert files[0].read_bytes() != files[1].read_bytes()
    assert [e["type"] for e in progress["ranks"][1]["processors"]] == ["linear_quant"]
    save = tmp_path / "out"
    _copy_checkpoint(killed, save)

    assert _run_group(_args(model, save, config_path, "--resume")) == [0, 0]

    _assert_same_export(save, uninterrupted)
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # the checkpoint folder is gone


def test_group_that_lost_a_process_keeps_its_checkpoint_and_resumes(
    model: Path,
    config_path: Path,
    uninterrupted: Path,
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """Process 1 is killed after layer 1's checkpoint; process 0 learns it in its next
    collective and keeps the checkpoint (it does not count as its own failure)."""
    save = tmp_path / "out"
    capfd.readouterr()
    codes = _run_group(_args(model, save, config_path), die_after={1: 1})
    err = capfd.readouterr().err
    assert codes == [1, KILLED]
    assert "another process of the group has ended" in err
    assert "interrupted: the finished work (2 of 3 decoder layers done) is kept" in err
    assert _progress(save)["layers_done"] == 2

    assert _run_group(_args(model, save, config_path, "--resume")) == [0, 0]

    _assert_same_export(save, uninterrupted)
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_group_killed_after_the_export_files_resumes_at_the_check(
    model: Path, config_path: Path, uninterrupted: Path, tmp_path: Path
) -> None:
    """Killed once every saver finalised: the resumed group runs no layer (process 0 rebuilds
    the quantized modules for the read-back check, process 1 has nothing to take up)."""
    save = tmp_path / "out"
    assert _run_group(_args(model, save, config_path), die_after={0: None, 1: None}) == [9, 9]
    progress = _progress(save)
    assert progress["stage"] == "finished" and progress["ranks"] == []
    assert not list(partial_path(save).glob("hidden-*"))  # every process removed its own

    assert _run_group(_args(model, save, config_path, "--resume")) == [0, 0]

    _assert_same_export(save, uninterrupted)
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_resume_with_another_number_of_processes_is_refused(
    model: Path,
    config_path: Path,
    killed: Path,
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
) -> None:
    save = tmp_path / "out"
    _copy_checkpoint(killed, save)
    with pytest.raises(ResumeError, match=r"number of processes \(dp_layer_wise\): 2 then, 1 now"):
        msquant.quantize(
            model, save, config_path, calib_path=CALIB_TXT, max_calib_tokens=24,
            progress=False, resume=True,
        )  # fmt: skip
    assert _progress(save)["layers_done"] == 1  # a refusal keeps the work

    # a single-process checkpoint resumed by 2 processes: process 0 refuses, and process 1
    # learns it from process 0 (it reads nothing itself) instead of waiting on it
    single = tmp_path / "single"
    codes = _run_group(_args(model, single, config_path), world_size=1, die_after={0: 0})
    assert codes == [KILLED]
    capfd.readouterr()
    assert _run_group(_args(model, single, config_path, "--resume")) == [2, 2]
    err = capfd.readouterr().err
    assert err.count("number of processes (dp_layer_wise): 1 then, 2 now") == 2
    assert "resumes with as many processes as it started with" in err
    assert _progress(single)["layers_done"] == 1


def test_damaged_hidden_states_of_one_process_stop_every_process(
    model: Path,
    config_path: Path,
    killed: Path,
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
) -> None:
    save = tmp_path / "out"
    _copy_checkpoint(killed, save)
    hidden = partial_path(save) / "hidden-00001-rank1.safetensors"
    hidden.write_bytes(hidden.read_bytes()[:-8])
    capfd.readouterr()

    assert _run_group(_args(model, save, config_path, "--resume")) == [2, 2]

    err = capfd.readouterr().err
    assert err.count("the hidden states of process 1 of the checkpoint") == 2
    # refused, nothing changed (--overwrite discards it, as the message says)
    assert [p.name for p in tmp_path.iterdir()] == [".out.msquant-partial"]
    assert hidden.is_file()
