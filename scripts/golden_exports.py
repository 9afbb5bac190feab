#!/usr/bin/env python
"""Record, or check, the sha256 of every file msquant exports for a fixed set of runs.

A refactoring that must not change behaviour (the architecture issue: "every export is
byte-identical") records the golden set before it moves anything and checks it after each step::

    python scripts/golden_exports.py record golden.json     # on the code before the change
    python scripts/golden_exports.py check golden.json      # after; exit 1 naming what differs

The runs: every file in ``yaml_examples/`` on a tiny Llama, per-module rules (``dynamic``, two
``linear_quant`` entries, ``-:`` rules), a quantized ``lm_head``, Qwen3-MoE and Mixtral exports in
every format, MX (W8A8_MXFP8, W4A4_MXFP4, MoE experts) in both formats that write it, a streamed
and a whole-model runner, and a run interrupted in its last layer (after the first layer's
checkpoint) then resumed. Models are random tiny models built from configs (seeded), calibrated on
the suite's ``tests/data/calib.txt``, all on the CPU with one thread.

Hashes are machine-dependent (float summation order differs between CPUs and BLAS builds), so
record and check on the same machine and torch build; the file is a working tool, not a test
fixture. ``quant_report.json`` is hashed with its timings (``*seconds``) and paths removed.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import logging
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from tiny_models import build_tiny_model  # noqa: E402

import msquant  # noqa: E402
import msquant.plugin  # noqa: E402
from msquant.plugin import DecoderLayer, Processor, ProcessorConfig, RunContext  # noqa: E402

CALIB = REPO / "tests" / "data" / "calib.txt"
EXAMPLES = REPO / "yaml_examples"
#: Files whose content depends on where and when the run happened.
REPORT_FILE = "quant_report.json"
VOLATILE_KEYS = ("model_path", "save_path")

logger = logging.getLogger("golden_exports")


def _entry(weight: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {"type": "linear_quant", "qconfig": {"weight": weight}, **fields}


def _config(*entries: dict[str, Any], save: tuple[str, ...] = ("gptq_saver",)) -> dict[str, Any]:
    return {
        "apiversion": "modelslim_v1",
        "spec": {"process": list(entries), "save": [{"type": s} for s in save]},
    }


INT4_G32_GPTQ = {
    "scope": "per_group",
    "dtype": "int4",
    "symmetric": True,
    "method": "gptq",
    "ext": {"group_size": 32},
}
INT8_CH_MINMAX = {"scope": "per_channel", "dtype": "int8", "symmetric": True, "method": "minmax"}
INT8_G32_ASYM = {
    "scope": "per_group",
    "dtype": "int8",
    "symmetric": False,
    "method": "minmax",
    "ext": {"group_size": 32},
}
ALL_FORMATS = ("gptq_saver", "compressed_tensors", "ascendv1_saver")
#: MX weights with MX activations of the same type (msModelSlim's W8A8_MXFP8 / W4A4_MXFP4).
MX_FORMATS = ("compressed_tensors", "ascendv1_saver")


def _mx(dtype: str) -> dict[str, Any]:
    return {"scope": "per_block", "dtype": dtype, "symmetric": True, "method": "minmax"}


def _mx_entry(dtype: str) -> dict[str, Any]:
    return {"type": "linear_quant", "qconfig": {"weight": _mx(dtype), "act": _mx(dtype)}}


#: name -> (model, config, extra quantize() keywords)
CASES: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "rules_mixed": (
        "llama",
        _config(
            _entry(
                INT4_G32_GPTQ,
                dynamic={"-:.*down_proj": {}, r".*\.1\..*": {"bits": 8, "group_size": -1}},
            ),
            save=("gptq_saver", "compressed_tensors"),
        ),
        {},
    ),
    "two_entries": (
        "llama",
        _config(
            _entry(INT4_G32_GPTQ, exclude=["*mlp*"]),
            _entry(INT8_G32_ASYM, include=["*mlp*"]),
            save=("compressed_tensors", "ascendv1_saver"),
        ),
        {},
    ),
    "lm_head": (
        "llama",
        _config(_entry(INT4_G32_GPTQ, lm_head=True), save=ALL_FORMATS[:2]),
        {},
    ),
    "model_wise": (
        "llama",
        {
            **_config(_entry(INT8_CH_MINMAX)),
            "spec": {**_config(_entry(INT8_CH_MINMAX))["spec"], "runner": "model_wise"},
        },
        {},
    ),  # fmt: skip
    "qwen3_moe": ("qwen3_moe", _config(_entry(INT4_G32_GPTQ), save=ALL_FORMATS), {}),
    "mixtral": ("mixtral", _config(_entry(INT8_CH_MINMAX), save=ALL_FORMATS), {}),
    "resumed": ("llama", _config(_entry(INT4_G32_GPTQ), save=ALL_FORMATS), {"kill_after": 1}),
    "w8a8_mxfp8": ("llama", _config(_mx_entry("mxfp8"), save=MX_FORMATS), {}),
    "w4a4_mxfp4": ("llama", _config(_mx_entry("mxfp4"), save=MX_FORMATS), {}),
    "qwen3_moe_mxfp4": ("qwen3_moe", _config(_mx_entry("mxfp4"), save=MX_FORMATS), {}),
}

MODELS: dict[str, dict[str, Any]] = {
    # hidden 128 so that every example's group size (up to 128) divides every layer
    "llama": {"arch": "llama", "hidden_size": 128, "intermediate_size": 256},
    "qwen3_moe": {"arch": "qwen3_moe", "num_layers": 2},
    "mixtral": {"arch": "mixtral", "num_layers": 2, "intermediate_size": 32},
}


class _KillConfig(ProcessorConfig):
    type: Literal["golden_kill"] = "golden_kill"


class _Kill(Processor):
    """Interrupts the run once, after the layer given by the class attribute (then lets the
    resumed run through): a kill after a checkpoint, through the public plugin API only."""

    type_name = "golden_kill"
    config_class = _KillConfig
    resumable = True
    after_index: int | None = None

    def after_layer(self, ctx: RunContext, layer: DecoderLayer) -> None:
        if _Kill.after_index is not None and layer.index == _Kill.after_index:
            _Kill.after_index = None
            raise KeyboardInterrupt


def _registry() -> msquant.plugin.ProcessorRegistry:
    registry = msquant.plugin.default_registry()
    registry.register(_Kill)
    return registry


def _normalised_report(data: Any) -> Any:
    """The run report without timings and paths (they change from run to run)."""
    if isinstance(data, Mapping):
        return {
            key: _normalised_report(value)
            for key, value in data.items()
            if not key.endswith("seconds") and key not in VOLATILE_KEYS
        }
    if isinstance(data, list):
        return [_normalised_report(item) for item in data]
    return data


def hash_export(folder: Path) -> dict[str, str]:
    """sha256 of every file under ``folder`` (the run report normalised first)."""
    hashes = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        data = path.read_bytes()
        if path.name == REPORT_FILE:
            normalised = _normalised_report(json.loads(data))
            data = json.dumps(normalised, sort_keys=True).encode()
        elif path.name == "msquant_export.json":
            data = json.dumps(_normalised_report(json.loads(data)), sort_keys=True).encode()
        hashes[str(path.relative_to(folder))] = hashlib.sha256(data).hexdigest()
    return hashes


@contextmanager
def _quiet() -> Iterator[None]:
    level = logging.getLogger("msquant").level
    logging.getLogger("msquant").setLevel(logging.ERROR)
    try:
        yield
    finally:
        logging.getLogger("msquant").setLevel(level)


def _run(model: Path, save: Path, config: dict[str, Any], kill_after: int | None = None) -> None:
    registry = _registry()
    if kill_after is None:
        msquant.quantize(model, save, config, calib_path=CALIB, registry=registry, progress=False)
        return
    killing = copy.deepcopy(config)
    killing["spec"]["process"].append({"type": "golden_kill"})
    _Kill.after_index = kill_after
    try:
        msquant.quantize(model, save, killing, calib_path=CALIB, registry=registry, progress=False)
    except KeyboardInterrupt:
        pass
    else:
        raise RuntimeError("the run was not interrupted")
    msquant.quantize(
        model, save, killing, calib_path=CALIB, registry=registry, progress=False, resume=True
    )


def _example_cases() -> dict[str, tuple[str, dict[str, Any], dict[str, Any]]]:
    cases = {}
    for path in sorted(EXAMPLES.glob("*.yaml")):
        cases[f"example/{path.stem}"] = ("llama", yaml.safe_load(path.read_text()), {})
    return cases


def record_all(work: Path, only: Callable[[str], bool] = lambda _: True) -> dict[str, Any]:
    """Run every case under ``work`` and return ``{case: {file: sha256}}``."""
    torch.set_num_threads(1)
    models = {
        name: build_tiny_model(work / "models" / name, **spec) for name, spec in MODELS.items()
    }
    results: dict[str, Any] = {}
    for name, (model, config, extra) in {**_example_cases(), **CASES}.items():
        if not only(name):
            continue
        save = work / "exports" / name.replace("/", "_")
        logger.info("running %s", name)
        with _quiet():
            _run(models[model], save, config, **extra)
        results[name] = hash_export(save)
    return results


def _differences(expected: Mapping[str, Any], found: Mapping[str, Any]) -> list[str]:
    problems = []
    for case in sorted(set(expected) | set(found)):
        if case not in found or case not in expected:
            problems.append(f"{case}: {'missing' if case not in found else 'new'} case")
            continue
        old, new = expected[case], found[case]
        for file in sorted(set(old) | set(new)):
            if old.get(file) != new.get(file):
                state = "missing" if file not in new else "new" if file not in old else "differs"
                problems.append(f"{case}: {file} {state}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("action", choices=("record", "check"))
    parser.add_argument("golden", type=Path, help="the JSON file of hashes")
    parser.add_argument("--only", default="", help="run only cases whose name contains this")
    parser.add_argument("--work", type=Path, help="keep models and exports here (default: temp)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with tempfile.TemporaryDirectory() as temporary:
        work = args.work or Path(temporary)
        found = record_all(work, lambda name: args.only in name)
    if args.action == "record":
        args.golden.write_text(json.dumps(found, indent=1, sort_keys=True) + "\n")
        logger.info("recorded %d case(s), %d file(s)", len(found), sum(map(len, found.values())))
        return 0
    expected = json.loads(args.golden.read_text())
    if args.only:
        expected = {case: files for case, files in expected.items() if args.only in case}
    problems = _differences(expected, found)
    for problem in problems:
        logger.error("%s", problem)
    logger.info("%d case(s) checked, %d difference(s)", len(found), len(problems))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
