"""``msquant verify --model_path``'s forward check: the logits error of honest exports, and of
tampered ones, from which its per-scheme bounds were set (msquant/verify/forward.py,
docs/reliability.md "Tampered rotations, norms and smoothing scales").

For every example config in ``yaml_examples/`` the model is quantized (once; an existing export
in ``--out`` is reused) and ``msquant.verify_export(export, model_path=model)`` is run: the
relative logits error on the check's fixed tokens, the top-1 agreement, the bound of the export's
scheme, whether verify passed and how long the forward check took.

The example with quarot is also run with round-to-nearest (minmax) weights, int8 and int4 (fast
on a real model). Then the rotated exports (``w4a8_dynamic_quarot`` and those two) and a smoothed
one (``w8a8_dynamic_iter_smooth``) are tampered with, one change at a time, each file's
checksum rewritten in ``msquant_export.json`` as if the export had been written so (what the
file checksums cannot see):

* ``norm_as_original``: layer 0's ``input_layernorm`` set back to the original model's values
  (quarot set it to ones, smoothing divided it by its scales);
* ``norm_doubled``: that norm multiplied by 2;
* ``weight_columns_permuted``: layer 0's ``up_proj`` codes with their input columns permuted (a
  wrong rotation applied to one quantized weight);
* ``scales_twice`` (smoothed export): the norm divided by the smoothing scales once more;
* ``rotation_replaced`` (rotated export): ``optional/quarot.safetensors`` holding another seed's
  Hadamard matrix.

For each: whether ``verify`` without the model fails (and its first error), the logits error and
top-1 agreement, and whether ``verify --model_path`` fails.

Usage::

    python bench/verify_forward.py --out /tmp/verify_forward            # tiny random Llama
    python bench/verify_forward.py --out /tmp/vf_smol --model DIR        # e.g. SmolLM2-135M
        [--only w8a16_per_channel_minmax,...] [--calib_tokens 256] [--json results.json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

import msquant
from msquant.plugin.numerics import rotation_for
from msquant.verify import export_folders
from msquant.verify.forward import compare_forward
from msquant.verify.report import Findings

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "yaml_examples"
CALIB_TXT = REPO / "tests" / "data" / "calib.txt"
ROTATED = "w4a8_dynamic_quarot"
SMOOTHED = "w8a8_dynamic_iter_smooth"
#: the rotated example with minmax W8A8_DYNAMIC weights (an 8-bit rotated export), and minmax
#: W4A8_DYNAMIC ones
ROTATED_W8 = "w8a8_dynamic_quarot_minmax"
ROTATED_RTN = "w4a8_dynamic_quarot_minmax"
NORM = "model.layers.0.input_layernorm.weight"
UP_PROJ = "model.layers.0.mlp.up_proj.weight"

logger = logging.getLogger("verify_forward")


def tiny_model(directory: Path) -> Path:
    """A 4-layer random Llama (hidden 128) with random norm scales (folding them matters)."""
    if (directory / "config.json").exists():
        return directory
    sys.path.insert(0, str(REPO / "tests"))
    from rotation_helpers import randomize_norms
    from tiny_models import build_tiny_model
    from transformers import AutoModelForCausalLM

    build_tiny_model(directory, "llama", hidden_size=128, intermediate_size=256, num_layers=4)
    model = AutoModelForCausalLM.from_pretrained(str(directory))
    randomize_norms(model)
    model.save_pretrained(str(directory))
    return directory


def configs(out: Path) -> dict[str, Path]:
    """Example name -> config file: every example, plus the rotated one with round-to-nearest
    (minmax) weights, 8-bit and 4-bit (fast on a real model, where GPTQ takes long on a CPU)."""
    found = {p.stem: p for p in sorted(EXAMPLES.glob("*.yaml"))}
    minmax = found[ROTATED].read_text(encoding="utf-8").replace("method: gptq", "method: minmax")
    for name, text in (
        (ROTATED_W8, minmax.replace("dtype: int4", "dtype: int8")),
        (ROTATED_RTN, minmax),
    ):
        extra = out / f"{name}.yaml"
        extra.write_text(text, encoding="utf-8")
        found[name] = extra
    return found


def quantize(model: Path, out: Path, config: Path, calib_tokens: int) -> Path:
    save = out / config.stem
    if not (save / "msquant_export.json").exists():
        started = time.perf_counter()
        msquant.quantize(
            model,
            save,
            config,
            calib_path=CALIB_TXT,
            max_calib_tokens=calib_tokens,
            progress=False,
            overwrite=True,
        )
        logger.info("%s: quantized in %.1f s", config.stem, time.perf_counter() - started)
    return save


def honest_row(name: str, export: Path, model: Path) -> list[dict[str, Any]]:
    rows = []
    for folder in export_folders(export):
        report = msquant.verify_export(folder, model_path=model)
        check = report.forward
        rows.append(
            {
                "config": name if folder == export else f"{name}/{folder.name}",
                "relative_error": check.relative_error if check else None,
                "top1": check.top1_agreement if check else None,
                "bound": check.bound if check else None,
                "scheme": check.scheme if check else None,
                "seconds": check.seconds if check else None,
                "ok": report.ok,
                "errors": report.errors[:2],
            }
        )
    return rows


def _weights_file(export: Path) -> Path:
    [file] = [p for p in export.glob("quant_model_weights*.safetensors")]
    return file


def _edit_weights(export: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> list[str]:
    file = _weights_file(export)
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})
    return [file.name]


def _rewrite_checksums(export: Path, names: list[str]) -> None:
    """As if the export had been written so: the marker's sha256 of ``names`` updated."""
    marker_path = export / "msquant_export.json"
    marker = json.loads(marker_path.read_text(encoding="utf-8"))
    for name in names:
        data = (export / name).read_bytes()
        marker["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    marker_path.write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")


def tampers(model: Path, rotated: bool) -> dict[str, Callable[[Path], list[str]]]:
    """Tamper name -> a function changing an export in place (returns the changed files)."""
    original = (
        load_file(model / "model.safetensors") if (model / "model.safetensors").exists() else None
    )

    def original_norm() -> torch.Tensor:
        if original is None:
            raise SystemExit("the tampers need a single-file model.safetensors")
        return original[NORM]

    def norm_as_original(export: Path) -> list[str]:
        def edit(t: dict[str, torch.Tensor]) -> None:
            t[NORM] = original_norm().to(t[NORM].dtype).clone()

        return _edit_weights(export, edit)

    def norm_doubled(export: Path) -> list[str]:
        def edit(t: dict[str, torch.Tensor]) -> None:
            t[NORM] = t[NORM] * 2

        return _edit_weights(export, edit)

    def weight_columns_permuted(export: Path) -> list[str]:
        def edit(t: dict[str, torch.Tensor]) -> None:
            codes = t[UP_PROJ]
            order = torch.randperm(codes.shape[1], generator=torch.Generator().manual_seed(0))
            t[UP_PROJ] = codes[:, order].contiguous()

        return _edit_weights(export, edit)

    def scales_twice(export: Path) -> list[str]:
        def edit(t: dict[str, torch.Tensor]) -> None:
            smoothed = t[NORM].to(torch.float64)
            scales = original_norm().to(torch.float64) / smoothed
            t[NORM] = (smoothed / scales).to(t[NORM].dtype)

        return _edit_weights(export, edit)

    def rotation_replaced(export: Path) -> list[str]:
        file = export / "optional" / "quarot.safetensors"
        rotation = load_file(file)["global_rotation"]
        other = rotation_for(rotation.shape[0], -1, seed=7).to(rotation.dtype).contiguous()
        save_file({"global_rotation": other}, file, metadata={"format": "pt"})
        return ["optional/quarot.safetensors"]

    found: dict[str, Callable[[Path], list[str]]] = {
        "norm_as_original": norm_as_original,
        "norm_doubled": norm_doubled,
        "weight_columns_permuted": weight_columns_permuted,
    }
    if rotated:
        found["rotation_replaced"] = rotation_replaced
    else:
        found["scales_twice"] = scales_twice
    return found


def tamper_rows(name: str, export: Path, model: Path, out: Path) -> list[dict[str, Any]]:
    rows = []
    for tamper, apply in tampers(model, name != SMOOTHED).items():
        copy = out / "tampered" / f"{name}-{tamper}"
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(export, copy)
        _rewrite_checksums(copy, apply(copy))
        alone = msquant.verify_export(copy)
        with_model = msquant.verify_export(copy, model_path=model)
        # the logits error even where verify stops before it (another error found first)
        check = with_model.forward or compare_forward(copy, model, alone.layers, Findings())
        rows.append(
            {
                "export": name,
                "tamper": tamper,
                "caught_without_model": not alone.ok,
                "first_error": (alone.errors or with_model.errors or [""])[0][:160],
                "relative_error": check.relative_error if check else None,
                "top1": check.top1_agreement if check else None,
                "bound": check.bound if check else None,
                "caught_with_model": not with_model.ok,
            }
        )
    return rows


def _cell(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, float) else str(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", type=Path, help="float model folder (default: tiny random)")
    parser.add_argument("--only", help="comma-separated example names")
    parser.add_argument("--calib_tokens", type=int, default=256)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logger.setLevel(logging.INFO)
    args.out.mkdir(parents=True, exist_ok=True)
    model = args.model or tiny_model(args.out / "tiny_model")
    chosen = configs(args.out)
    if args.only:
        chosen = {k: v for k, v in chosen.items() if k in args.only.split(",")}
    honest: list[dict[str, Any]] = []
    tampered: list[dict[str, Any]] = []
    for name, config in chosen.items():
        try:
            export = quantize(model, args.out, config, args.calib_tokens)
        except msquant.MsquantInputError as exc:  # e.g. a group size the model's widths refuse
            logger.warning("%s: not applicable to this model: %s", name, str(exc).split("\n")[0])
            continue
        honest += honest_row(name, export, model)
        if name in (ROTATED, ROTATED_W8, ROTATED_RTN, SMOOTHED):
            tampered += tamper_rows(name, export, model, args.out)
    print("| config | scheme | rel. logits error | top-1 | bound | verify | forward s |")
    print("|---|---|---|---|---|---|---|")
    for row in honest:
        print(
            f"| {row['config']} | {row['scheme']} | {_cell(row['relative_error'])} | "
            f"{_cell(row['top1'])} | {row['bound']} | {'OK' if row['ok'] else 'FAILED'} | "
            f"{_cell(row['seconds'])} |"
        )
    print()
    print("| export | tamper | verify alone | rel. logits error | top-1 | bound | --model_path |")
    print("|---|---|---|---|---|---|---|")
    for row in tampered:
        print(
            f"| {row['export']} | {row['tamper']} | "
            f"{'FAILED' if row['caught_without_model'] else 'OK'} | "
            f"{_cell(row['relative_error'])} | {_cell(row['top1'])} | {row['bound']} | "
            f"{'FAILED' if row['caught_with_model'] else 'OK'} |"
        )
    if args.json:
        args.json.write_text(json.dumps({"honest": honest, "tampered": tampered}, indent=2))


if __name__ == "__main__":
    main()
