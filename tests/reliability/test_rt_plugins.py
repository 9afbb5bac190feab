"""Red-team replays, round 3 (issue 24): third-party plugins that break on import, exit from it,
or take a built-in's name. Each is installed for real: a ``*.dist-info`` folder with its
``entry_points.txt`` and the plugin's module, on ``sys.path``."""

from __future__ import annotations

import importlib
import re
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from replay import Cli, quant_args, replay

Install = Callable[[str, str, str], None]


@pytest.fixture
def install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Install:
    """``install(distribution, entry_points_txt, module_source)``: a distribution on ``sys.path``
    declaring the entry points, with one module ``rt_<distribution>``."""
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))

    def add(distribution: str, entry_points: str, source: str) -> None:
        info = site / f"{distribution}-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: {distribution}\nVersion: 1.0\n", encoding="utf-8"
        )
        (info / "entry_points.txt").write_text(entry_points, encoding="utf-8")
        module = f"rt_{distribution.replace('-', '_')}"
        (site / f"{module}.py").write_text(source, encoding="utf-8")
        monkeypatch.delitem(sys.modules, module, raising=False)
        importlib.invalidate_caches()

    return add


def _uses(root: Path, processor: str) -> str:
    path = root / f"uses_{processor}.yaml"
    path.write_text(
        f"apiversion: modelslim_v1\nspec:\n  process:\n    - type: {processor}\n", encoding="utf-8"
    )
    return path.name


@pytest.mark.parametrize(
    ("statement", "raised"),
    [
        ("raise SystemExit(0)", "its import raised SystemExit(0)"),
        ("raise KeyboardInterrupt", "its import raised KeyboardInterrupt()"),
        ("import rt_no_such_dependency", "ModuleNotFoundError: No module named"),
    ],
    ids=["system_exit_0", "keyboard_interrupt", "import_error"],
)
def test_a_plugin_whose_import_fails_breaks_only_the_runs_that_use_it(
    case: Path, run_cli: Cli, install: Install, statement: str, raised: str
) -> None:
    """SystemExit(0) on import made every ``msquant quant`` exit 0 with nothing written (a CI
    suite reported success); an import error was a traceback (exit 1) for every run."""
    install("evil-plugin", "[msquant.processors]\nevil = rt_evil_plugin:Evil\n", statement + "\n")
    where = "(distribution evil-plugin, entry point evil = rt_evil_plugin:Evil in group"
    outcome = replay(run_cli, case, *quant_args(case))
    assert outcome.code == 0, outcome.err
    assert (case / "out" / "msquant_export.json").is_file()
    assert "Traceback" not in outcome.err
    assert f"processor plugin 'evil' {where} msquant.processors) failed to import" in outcome.err
    assert "runs that use 'evil' are refused" in outcome.err
    using = quant_args(case, "--save_path", case / "out2", config=_uses(case, "evil"))
    replay(run_cli, case, *using).refused(
        rf"spec.process\[0\].type: the processor plugin 'evil' \(distribution evil-plugin, "
        rf"entry point evil = rt_evil_plugin:Evil in group msquant.processors\) failed to "
        rf"import: {re.escape(raised)}.*; fix or uninstall evil-plugin \(pip uninstall evil-plugin\)"
    )


def test_a_plugin_re_registering_a_built_in_name_is_refused_naming_it(
    case: Path, run_cli: Cli, install: Install
) -> None:
    """A plugin claiming ``linear_quant`` was a traceback (exit 1) for every run; now a run that
    names the contested type is refused (exit 2) naming the distribution and both entry points,
    and runs that do not name it are unaffected."""
    install(
        "rival",
        "[msquant.processors]\nlinear_quant = rt_rival:Rival\n",
        "from msquant.processors.linear_quant.processor import LinearQuantProcessor\n\n"
        "class Rival(LinearQuantProcessor):\n    pass\n",
    )
    replay(run_cli, case, *quant_args(case)).refused(
        r"spec.process\[0\].type: the processor plugin 'linear_quant' \(distribution rival, "
        r"entry point linear_quant = rt_rival:Rival in group msquant.processors\) claims the "
        r"name 'linear_quant', which msquant's built-in entry point linear_quant = "
        r"msquant.processors.linear_quant.processor:LinearQuantProcessor claims too; .*uninstall rival"
    )
    assert replay(run_cli, case, "validate", case / _uses(case, "iter_smooth")).code == 0


def test_system_exit_raised_by_a_plugin_during_a_run_is_not_a_success(
    case: Path, run_cli: Cli, install: Install
) -> None:
    """A processor calling ``sys.exit(0)`` mid-run ended ``msquant quant`` with exit 0 and no
    export."""
    install(
        "quitter",
        "[msquant.processors]\nquitter = rt_quitter:Quitter\n",
        "from typing import Literal\n"
        "from msquant.plugin import Processor, ProcessorConfig\n\n"
        "class QuitterConfig(ProcessorConfig):\n"
        "    type: Literal['quitter'] = 'quitter'\n\n"
        "class Quitter(Processor):\n"
        "    type_name = 'quitter'\n"
        "    config_class = QuitterConfig\n\n"
        "    def setup(self, ctx):\n"
        "        raise SystemExit(0)\n",
    )
    config = case / "quit.yaml"
    config.write_text((case / "w8.yaml").read_text() + "    - type: quitter\n", encoding="utf-8")
    outcome = replay(run_cli, case, *quant_args(case, config="quit.yaml"))
    assert outcome.code == 1, outcome.err
    assert "SystemExit(0) was raised inside the command" in outcome.err
    assert not (case / "out").exists()
