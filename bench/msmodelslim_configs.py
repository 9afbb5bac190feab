"""Which of msModelSlim's shipped configs msquant accepts: ``msquant validate`` on every config
YAML of msModelSlim's wheel (the ``lab_practice`` best practices and any other file with an
``apiversion``), one table row each.

Usage::

    python bench/msmodelslim_configs.py                       # pip download --no-deps msmodelslim==26.1.0
    python bench/msmodelslim_configs.py --wheel msmodelslim-26.1.0-py3-none-any.whl
    python bench/msmodelslim_configs.py --dir site-packages/msmodelslim   # an installed copy
    python bench/msmodelslim_configs.py --markdown > table.md
    python bench/msmodelslim_configs.py --apiversion modelslim_v1 --run   # also run the valid ones
    python bench/msmodelslim_configs.py --only qwen3/qwen3-32b-dense-w8a8c8 --run   # just those files
    python bench/msmodelslim_configs.py --apiversion modelslim_v1 --apiversion multimodal_vlm_modelslim_v1 --run

The downloaded wheel is kept in ``--cache`` (default ``~/.cache/msquant/msmodelslim``) and used
from there next time; nothing is installed and none of its code is run. Every file is validated
with the installed msquant's processors (``msquant.default_registry()``), exactly as ``msquant
validate`` does; a refused file names, in the ``missing`` column, what msquant lacks (processor
types, weight methods, activation schemes, the apiversion) and, in ``first error``, the first
problem ``msquant validate`` reports.

``--run`` then runs every file that validates on a tiny model of its architecture family
(``msquant quant`` with the file unchanged except the calibration data, then ``msquant verify``;
``bench/practice_runs.py``) and prints a second table: model used, verdict, seconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import subprocess
import sys
import zipfile
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import msquant
from msquant.config.yaml_loader import load_yaml_text

logger = logging.getLogger("msmodelslim_configs")

VERSION = "26.1.0"
DEFAULT_CACHE = Path.home() / ".cache" / "msquant" / "msmodelslim"


@dataclass(frozen=True)
class Row:
    """One config file: what it asks for and msquant's verdict."""

    file: str
    apiversion: str
    schemes: str
    processors: str
    verdict: str
    missing: str
    first_error: str
    msmodelslim: str = ""


def wheel_path(cache: Path, version: str) -> Path:
    """The wheel in ``cache``, downloaded with ``pip download --no-deps`` when absent."""
    found = sorted(cache.glob(f"msmodelslim-{version}-*.whl"))
    if found:
        return found[0]
    cache.mkdir(parents=True, exist_ok=True)
    logger.info("downloading msmodelslim==%s into %s", version, cache)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
         f"msmodelslim=={version}", "-d", str(cache)],
        check=True,
    )  # fmt: skip
    found = sorted(cache.glob(f"msmodelslim-{version}-*.whl"))
    if not found:
        raise SystemExit(f"pip download left no msmodelslim-{version} wheel in {cache}")
    return found[0]


def yaml_files(wheel: Path | None, directory: Path | None) -> Iterator[tuple[str, str]]:
    """``(name, text)`` of every YAML file of the wheel or folder, in name order."""
    if wheel is not None:
        with zipfile.ZipFile(wheel) as archive:
            for name in sorted(archive.namelist()):
                if name.endswith((".yaml", ".yml")):
                    yield name, archive.read(name).decode("utf-8", errors="replace")
        return
    assert directory is not None
    for path in sorted(directory.rglob("*.y*ml")):
        yield str(path.relative_to(directory.parent)), path.read_text(encoding="utf-8")


def linear_entries(entries: Any) -> Iterator[dict[str, Any]]:
    """Every ``linear_quant`` entry in a process list, inside ``group`` entries too."""
    for entry in entries if isinstance(entries, list) else []:
        if not isinstance(entry, dict):
            continue
        if entry.get("type") == "linear_quant":
            yield entry
        yield from linear_entries(entry.get("configs"))


def processor_types(entries: Any) -> Iterator[str]:
    """Every processor ``type`` in a process list, ``group`` children as ``group[a+b]``."""
    for entry in entries if isinstance(entries, list) else []:
        if not isinstance(entry, dict):
            continue
        kind = str(entry.get("type"))
        children = list(processor_types(entry.get("configs")))
        yield f"{kind}[{'+'.join(children)}]" if children else kind


def scheme_name(qconfig: Any) -> str:
    """``W8A8_DYNAMIC``-style name of a ``linear_quant`` qconfig, with the weight method."""
    if not isinstance(qconfig, dict):
        return "?"
    weight = qconfig.get("weight") or {}
    act = qconfig.get("act") or {}
    w_dtype = str(weight.get("dtype", "?"))
    a_dtype = str(act.get("dtype", "float"))
    w_bits = w_dtype[3:] if w_dtype.startswith("int") else w_dtype
    if a_dtype == "float":
        name = f"W{w_bits}A16"
    elif a_dtype == "int8" and act.get("scope") == "per_token":
        name = f"W{w_bits}A8_DYNAMIC"
    elif a_dtype == "int8" and act.get("scope") == "per_tensor":
        name = f"W{w_bits}A8"
    elif a_dtype == "int8" and act.get("scope") == "pd_mix":
        name = f"W{w_bits}A8_MIX"
    else:
        name = f"W:{w_dtype}/A:{a_dtype}-{act.get('scope', '?')}"
    return f"{name} {weight.get('method', '?')}"


def missing_of(issues: list[msquant.ConfigIssue], data: dict[str, Any]) -> list[str]:
    """What msquant lacks for this file, read from the issues ``msquant validate`` reports."""
    found: list[str] = []
    if any(issue.path == "apiversion" for issue in issues):  # the other errors follow from it
        return [f"apiversion {data.get('apiversion')!r}"]
    for issue in issues:
        message = issue.message
        if message.startswith("unknown key"):
            found.append(f"key {issue.path}")
        elif "unknown processor type" in message:
            found.append("processor " + message.split("'")[1])
        elif issue.path.endswith("qconfig.weight.method") or "unknown weight method" in message:
            found.append("method " + (message.split("'")[1] if "'" in message else "?"))
        elif issue.path.endswith("qconfig.act"):
            found.append("activation scheme")
        elif issue.path.endswith("qconfig.weight"):
            found.append("weight scheme")
        elif issue.path.endswith("dataset"):
            found.append("dataset")
        else:
            found.append(issue.path.split(".")[-1] or "config")
    return sorted(set(found))


def check(name: str, text: str, registry: msquant.plugin.ProcessorRegistry) -> Row | None:
    """The row of one file (None for a YAML file that is not a config: no ``apiversion``)."""
    try:
        data = load_yaml_text(text, name)
    except msquant.MsquantInputError as exc:
        return Row(name, "?", "", "", "unreadable", "", str(exc).splitlines()[0])
    if not isinstance(data, dict) or "apiversion" not in data:
        return None
    spec = data.get("spec") if isinstance(data.get("spec"), dict) else {}
    assert isinstance(spec, dict)
    stages = [spec.get("process")] + [
        p.get("process") for p in spec.get("prior") or [] if isinstance(p, dict)
    ]
    schemes = sorted({scheme_name(e.get("qconfig")) for s in stages for e in linear_entries(s)})
    kinds = [kind for s in stages for kind in processor_types(s)]
    if spec.get("prior"):
        kinds.insert(0, f"prior x{len(spec['prior'])}")
    try:
        msquant.validate_config(data, registry, name)
    except msquant.ConfigError as exc:
        missing = missing_of(list(exc.issues), data)
        first = str(exc.issues[0]) if exc.issues else str(exc)
        verdict = f"refused ({len(exc.issues)})"
        return Row(name, str(data["apiversion"]), ", ".join(schemes), ", ".join(kinds), verdict,
                   "; ".join(missing), first)  # fmt: skip
    return Row(name, str(data["apiversion"]), ", ".join(schemes), ", ".join(kinds), "valid", "", "")


def summary(rows: list[Row]) -> list[str]:
    """Counts per apiversion, and the most common missing items."""
    lines = []
    for apiversion in sorted({r.apiversion for r in rows}):
        mine = [r for r in rows if r.apiversion == apiversion]
        valid = sum(r.verdict == "valid" for r in mine)
        lines.append(f"{apiversion}: {valid} of {len(mine)} validate")
    best = [r for r in rows if "/lab_practice/" in f"/{r.file}"]
    not_sd = [r for r in best if r.apiversion != "multimodal_sd_modelslim_v1"]
    lines.append(
        f"lab_practice: {sum(r.verdict == 'valid' for r in best)} of {len(best)} validate "
        f"({sum(r.verdict == 'valid' for r in not_sd)} of {len(not_sd)} without the SD ones)"
    )
    causes = Counter(item for r in rows for item in r.missing.split("; ") if item)
    both = [r for r in rows if r.msmodelslim == "parses"]
    if both:
        lines.append(
            f"of the {len(both)} files msModelSlim's own parser accepts, msquant validates "
            f"{sum(r.verdict == 'valid' for r in both)}"
        )
    lines.append("missing (files): " + ", ".join(f"{k} {v}" for k, v in causes.most_common()))
    return lines


def short(name: str) -> str:
    """The file name below ``lab_practice/`` (or the package)."""
    for marker in ("lab_practice/", "msmodelslim/"):
        if marker in name:
            return name.split(marker, 1)[1]
    return name


#: Run by ``--msmodelslim_python`` (msModelSlim's own interpreter): msModelSlim's parser on each
#: file given as (name, YAML text) pairs in JSON on stdin; prints one verdict per line.
PARSER = """
import json, sys, yaml
from msmodelslim.core.quant_service.interface import BaseQuantConfig
from msmodelslim.core.quant_service.modelslim_v1.quant_config import ModelslimV1QuantConfig
from msmodelslim.core.quant_service.multimodal_vlm_v1.quant_config import (
    MultimodalVLMModelslimV1QuantConfig,
)
PARSERS = {"modelslim_v1": ModelslimV1QuantConfig,
           "multimodal_vlm_modelslim_v1": MultimodalVLMModelslimV1QuantConfig}
for name, text in json.load(sys.stdin):
    try:
        base = BaseQuantConfig.model_validate(yaml.safe_load(text))
        if base.apiversion in PARSERS:
            PARSERS[base.apiversion].from_base(base)
            print("parses")
        else:
            print("(other service)")
    except Exception as exc:
        print("refuses: " + " ".join(str(exc).split())[:160])
"""


def msmodelslim_verdicts(python: Path, files: list[tuple[str, str]]) -> list[str]:
    """msModelSlim's own parser's verdict on each file, run in its interpreter."""
    done = subprocess.run(
        [str(python), "-c", PARSER], input=json.dumps(files), capture_output=True, text=True,
        check=True,
    )  # fmt: skip
    verdicts = [line for line in done.stdout.splitlines() if line.strip()]
    if len(verdicts) != len(files):
        raise SystemExit(f"msModelSlim's parser gave {len(verdicts)} verdicts for {len(files)}")
    return verdicts


def render(rows: list[Row], markdown: bool) -> str:
    header = ["file", "apiversion", "schemes", "processors", "verdict", "missing", "first error"]
    body = [[short(r.file), r.apiversion, r.schemes, r.processors, r.verdict, r.missing,
             r.first_error] for r in rows]  # fmt: skip
    if any(r.msmodelslim for r in rows):
        header.append("msModelSlim 26.1.0")
        for row, r in zip(body, rows, strict=True):
            row.append(r.msmodelslim)
    if markdown:
        cells = [[c.replace("|", "\\|") for c in row] for row in body]
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(row) + " |" for row in cells]
        return "\n".join(lines)
    return "\n".join("\t".join(row) for row in [header, *body])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--wheel", type=Path, help="a local msmodelslim wheel")
    source.add_argument("--dir", type=Path, help="an unpacked or installed msmodelslim package")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--version", default=VERSION)
    parser.add_argument(
        "--apiversion",
        action="append",
        help="only files of this apiversion (repeatable: modelslim_v1, multimodal_vlm_modelslim_v1)",
    )
    parser.add_argument(
        "--only",
        action="append",
        help="only files whose path contains this text (repeatable), e.g. qwen3/qwen3-32b-dense-w8a8c8",
    )
    parser.add_argument("--markdown", action="store_true", help="a Markdown table")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    parser.add_argument(
        "--msmodelslim_python",
        type=Path,
        help="the python of a venv with msModelSlim installed: add its own parser's verdict",
    )
    parser.add_argument(
        "--run",
        action="store_true",
        help="run every file that validates on a tiny model of its family (quant + verify)",
    )
    parser.add_argument("--run_dir", type=Path, help="keep the --run models and exports here")
    parser.add_argument("--run_json", type=Path, help="also write the --run rows as JSON here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    logging.getLogger("msquant").setLevel(logging.ERROR)  # pattern warnings, anchors: not here
    wheel = args.wheel
    if wheel is None and args.dir is None:
        wheel = wheel_path(args.cache, args.version)
    registry = msquant.plugin.default_registry()
    checked = [
        (row, name, text)
        for name, text in yaml_files(wheel, args.dir)
        if (row := check(name, text, registry)) is not None
        and (args.apiversion is None or row.apiversion in args.apiversion)
        and (args.only is None or any(part in name for part in args.only))
    ]
    rows = [row for row, _, _ in checked]
    if args.msmodelslim_python is not None:
        verdicts = msmodelslim_verdicts(args.msmodelslim_python, [(n, t) for _, n, t in checked])
        rows = [dataclasses.replace(r, msmodelslim=v) for r, v in zip(rows, verdicts, strict=True)]
    print(render(rows, args.markdown))
    print()
    for line in summary(rows):
        print(line)
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1) + "\n")
    if args.run:
        valid = [
            (r, n, t) for r, (_, n, t) in zip(rows, checked, strict=True) if r.verdict == "valid"
        ]
        run_valid([(n, t) for _, n, t in valid], [r.apiversion for r, _, _ in valid], args)
    return 0


def run_valid(
    files: list[tuple[str, str]], apiversions: list[str], args: argparse.Namespace
) -> None:
    """``--run``: quantize and verify each valid file on its family's tiny model; print the table
    and the verdicts' counts per apiversion."""
    from practice_runs import render_runs, run_configs

    runs = [dataclasses.replace(r, file=short(r.file)) for r in run_configs(files, args.run_dir)]
    print()
    print(render_runs(runs, args.markdown))
    print()
    for apiversion in sorted(set(apiversions)):
        mine = [r for r, a in zip(runs, apiversions, strict=True) if a == apiversion]
        verdicts = Counter(r.verdict for r in mine)
        counts = ", ".join(f"{v} {k}" for k, v in verdicts.items())
        print(f"run, {apiversion}: {len(mine)} valid files: {counts}")
    if args.run_json is not None:
        args.run_json.write_text(json.dumps([asdict(r) for r in runs], indent=1) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
