"""Replaying the red-team cases of issue 14 (docs/reliability.md): run ``msquant`` as a user
would, and compare the file tree around it before and after.

A case asserts three things: the exit code, the message (one ``msquant: error:`` and no traceback
for bad input) and what changed on disk (:class:`Outcome`: entries added, removed, changed under
the case's folder, hidden ones and symbolic links included). Kills are real: a forked child (with
everything imported already, so it starts in milliseconds) sends itself SIGKILL where the case
says (:func:`run_forked`).
"""

from __future__ import annotations

import hashlib
import inspect
import os
import re
import signal
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

from msquant.cli import main

REPO = Path(__file__).resolve().parents[2]
CALIB_TXT = REPO / "tests" / "data" / "calib.txt"

MINMAX_YAML = """\
apiversion: modelslim_v1
spec:
  process:
    - type: linear_quant
      qconfig:
        weight: {dtype: int8, scope: per_channel, symmetric: true, method: minmax}
"""

GPTQ_YAML = """\
apiversion: modelslim_v1
spec:
  process:
    - type: linear_quant
      qconfig:
        weight: {dtype: int8, scope: per_channel, symmetric: true, method: gptq}
"""


def quant_args(root: Path, *extra: object, config: str = "w8.yaml") -> list[object]:
    """``quant`` on the case's model and config, saving to ``out`` (unless ``extra`` says)."""
    args: list[object] = ["quant", "--model_path", root / "model", "--config_path", root / config]
    if "--save_path" not in extra:
        args += ["--save_path", root / "out"]
    if config == "gptq.yaml":
        args += ["--calib_path", CALIB_TXT, "--max_calib_tokens", "32"]
    return [*args, "--no_progress", *extra]


KILLED = -signal.SIGKILL  # the exit code os.waitstatus_to_exitcode gives a SIGKILLed child


def tree(root: Path) -> dict[str, str]:
    """Every entry under ``root`` (hidden ones too; links not followed): relative path ->
    ``dir``, ``link:<target>`` or ``file:<sha256>``."""
    entries: dict[str, str] = {}
    for directory, folders, files in os.walk(root, followlinks=False):
        for name in [*folders, *files]:
            path = Path(directory) / name
            relative = path.relative_to(root).as_posix()
            if path.is_symlink():
                entries[relative] = f"link:{os.readlink(path)}"
            elif path.is_dir():
                entries[relative] = "dir"
            else:
                entries[relative] = "file:" + hashlib.sha256(path.read_bytes()).hexdigest()
    return entries


@dataclass
class Outcome:
    """One command's exit code, output, and the tree under the case's folder around it."""

    code: int
    out: str
    err: str
    before: dict[str, str]
    after: dict[str, str]

    @property
    def added(self) -> list[str]:
        return sorted(set(self.after) - set(self.before))

    @property
    def removed(self) -> list[str]:
        return sorted(set(self.before) - set(self.after))

    @property
    def changed(self) -> list[str]:
        common = set(self.before) & set(self.after)
        return sorted(p for p in common if self.before[p] != self.after[p])

    def refused(
        self, pattern: str, lead: str = "msquant: error:", stale: Sequence[str] = ()
    ) -> None:
        """Exit 2, one message (starting with ``lead``) matching ``pattern``, no traceback,
        nothing changed on disk but the removal of entries starting with one of ``stale`` (what
        a killed run left: its lock file, its scratch folders)."""
        assert self.code == 2, self.err
        self.one_error(pattern, lead)
        removed = [p for p in self.removed if not p.startswith(tuple(stale) or ("\0",))]
        changes = (self.added, removed, self.changed)
        assert changes == ([], [], []), f"the tree changed: added, removed, changed {changes}"

    def invalid(self, pattern: str) -> None:
        """``msquant validate``'s refusal: its report instead of ``msquant: error:``."""
        self.refused(pattern, lead="invalid quantization config in ")

    def one_error(self, pattern: str, lead: str = "msquant: error:") -> None:
        assert "Traceback" not in self.err and "internal error" not in self.err, self.err
        assert self.err.count(lead) == 1, self.err
        message = self.err[self.err.index(lead) :]
        assert re.search(pattern, message, re.S), message

    def succeeded(self) -> None:
        assert self.code == 0, self.err
        assert "Traceback" not in self.err and "error" not in self.err.lower(), self.err


Cli = Callable[..., Any]


def replay(run_cli: Cli, root: Path, *args: object) -> Outcome:
    """Run ``msquant *args`` in this process; the tree is taken under ``root``."""
    before = tree(root)
    result = run_cli(*[str(a) for a in args])
    return Outcome(result.code, result.out, result.err, before, tree(root))


def on_entry(function: Callable[..., Any], action: Callable[[], None], call: int = 1) -> None:
    """Run ``action`` when ``function`` is entered for the ``call``-th time, however it is
    reached (a method, an imported name, a property's getter, a context manager's generator): a
    profile hook watches for its code object. Use it in a forked child."""
    target = inspect.unwrap(function)
    code = target.fget.__code__ if isinstance(target, property) else target.__code__
    calls = [0]

    def watch(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code is code:
            calls[0] += 1
            if calls[0] == call:
                sys.setprofile(None)
                action()

    sys.setprofile(watch)


def kill_on_entry(function: Callable[..., Any], call: int = 1) -> None:
    """SIGKILL the process when ``function`` is entered for the ``call``-th time."""
    on_entry(function, lambda: os.kill(os.getpid(), signal.SIGKILL), call)


def pause_on_entry(function: Callable[..., Any], ready: Path, go: Path) -> None:
    """When ``function`` is entered, create ``ready`` and wait until ``go`` exists."""

    def pause() -> None:
        ready.touch()
        while not go.exists():
            time.sleep(0.02)

    on_entry(function, pause)


def run_forked(
    args: Sequence[object],
    log: Path,
    prepare: Callable[[], None] = lambda: None,
    timeout: float = 120,
) -> int:
    """Run ``msquant *args`` in a forked child after ``prepare()`` (which patches the kill point
    in); returns the child's exit code (``KILLED`` when it killed itself). Its output goes to
    ``log``."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 99
        try:
            stream = open(log, "w", encoding="utf-8", buffering=1)
            sys.stdout = sys.stderr = stream
            prepare()
            code = main([str(a) for a in args])
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stderr.flush()
            os._exit(code)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail(f"the forked run did not end within {timeout} s: {log.read_text()[-2000:]}")


needs_fork = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")


def export_files(root: Path) -> dict[str, Any]:
    """An export's content for comparing two runs: every file's bytes, but the marker's file list
    only and the report without its timings and model path (both name the model folder, which
    differs between the runs compared)."""
    import json

    from msquant.report.document import strip_timings

    files: dict[str, Any] = {}
    for path in sorted(root.rglob("*")):
        if not path.is_file():
            continue
        name = path.relative_to(root).as_posix()
        if path.name == "msquant_export.json":
            files[name] = json.loads(path.read_text())["files"]
        elif path.name == "quant_report.json":
            report = strip_timings(json.loads(path.read_text()))
            report.pop("model_path", None)
            files[name] = report
        else:
            files[name] = path.read_bytes()
    return files
