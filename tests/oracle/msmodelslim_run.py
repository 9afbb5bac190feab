"""Run msModelSlim 26.1.0's v1 pipeline on tiny models: the oracle for the activation schemes.

msModelSlim is never imported here: it runs as its own CLI (``msmodelslim quant``) from a separate
virtual environment (``scripts/msmodelslim_env.sh``), on CPU, on tiny float32 Llama / Qwen models
built offline by :mod:`tiny_models` and on a calibration file written from the test corpus. The
exports land in a cache folder outside the repository and are compared by
``tests/oracle/test_msmodelslim_oracle.py`` (pytest marker ``msmodelslim``).

Usage (from the repository root)::

    scripts/msmodelslim_env.sh                      # once: builds $MSQUANT_MSMODELSLIM_VENV
    python tests/oracle/msmodelslim_run.py [--cache DIR] [--scheme NAME ...] [--arch NAME ...]

The configs are modelled on msModelSlim's shipped best practices (``lab_practice``) and smoke
configs, without the smoothing and rotation processors: one ``linear_quant`` entry with the
scheme's ``act`` / ``weight`` qconfig and an ``ascendv1_saver``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent
#: The thread settings both sides of the oracle run under (msModelSlim's process gets them in its
#: environment, msquant's sets torch's thread count from them).
THREAD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
DEFAULT_CACHE = Path(os.environ.get("MSQUANT_ORACLE_CACHE", Path.home() / ".cache/msquant/oracle"))
DEFAULT_VENV = Path(
    os.environ.get("MSQUANT_MSMODELSLIM_VENV", Path.home() / ".cache/msquant/msmodelslim-venv")
)
#: The tiny models: name -> builder arguments (hidden 64, intermediate 128, 2 layers). Qwen2 has
#: q/k/v biases; the bf16 Llama shows how ``deq_scale`` is stored for bf16 models; Qwen3-MoE
#: (8 experts) how MoE experts are written, through msModelSlim's own Qwen3-MoE adapter
#: (``model_type``, its ``--model_type`` name; ``default`` otherwise).
ARCHS: dict[str, dict[str, Any]] = {
    "llama": {"arch": "llama"},
    "qwen2": {"arch": "qwen2"},
    "qwen3": {"arch": "qwen3"},
    "llama_bf16": {"arch": "llama", "dtype": "bfloat16"},
    "qwen3_moe": {"arch": "qwen3_moe", "model_type": "Qwen3-30B"},
    # the tiny Qwen3 through msModelSlim's own Qwen3 adapter, which names all four smoothing
    # subgraphs (norm-linear, ov, up-down); its default adapter finds norm -> linears only
    "qwen3_adapter": {"arch": "qwen3", "model_type": "Qwen3-8B"},
    # the same in bfloat16: the smoothing statistics, the alpha/beta search and the folds in bf16
    "qwen3_bf16_adapter": {"arch": "qwen3", "dtype": "bfloat16", "model_type": "Qwen3-8B"},
    # the tiny Qwen2 through msModelSlim's QwQ adapter: iter_smooth gets norm-linear and up-down
    # subgraphs from it, flex_smooth_quant (no interface) finds norm-linear ones itself
    "qwen2_qwq": {"arch": "qwen2", "model_type": "QwQ-32B"},
    # routed MoE experts (issue 25): tiny DeepSeek-V3 / GLM-4-MoE (3 layers, the first dense, 8
    # experts and a shared one) through the test adapter of moe_adapter/ (msModelSlim's
    # deepseek_v3_2 / glm_5 adapters' up-down subgraphs on transformers' classes, experts split
    # per expert); msquant runs under the --model_type those practices name
    "deepseek_v3_moe": {
        "arch": "deepseek_v3", "num_layers": 3, "model_type": "msquant-moe-oracle",
        "plugin": "moe_adapter", "msquant_model_type": "DeepSeek-V3.2",
    },
    "glm4_moe_moe": {
        "arch": "glm4_moe", "num_layers": 3, "model_type": "msquant-moe-oracle",
        "plugin": "moe_adapter", "msquant_model_type": "GLM-5",
    },
}  # fmt: skip
#: Keys of :data:`ARCHS` that are no model builder argument.
_RUN_KEYS = ("model_type", "plugin", "msquant_model_type")
#: Calibration samples taken from the test corpus (blank-line separated paragraphs).
CALIB_SAMPLES = 12

logger = logging.getLogger("msmodelslim_run")


def _act(scope: str, symmetric: bool) -> dict[str, Any]:
    return {"scope": scope, "dtype": "int8", "symmetric": symmetric, "method": "minmax"}


def _weight(
    dtype: str, scope: str = "per_channel", method: str = "minmax", **ext: Any
) -> dict[str, Any]:
    weight = {"scope": scope, "dtype": dtype, "symmetric": True, "method": method}
    return {**weight, "ext": ext} if ext else weight


@dataclass(frozen=True)
class Scheme:
    """One activation scheme: the ``qconfig`` of its ``linear_quant`` entry and the
    ``model_quant_type`` msModelSlim is expected to write for it."""

    name: str
    qconfig: dict[str, Any]
    quant_type: str
    #: msModelSlim 26.1.0 refuses the scheme on CPU with this message (no export is made).
    refused: str | None = None
    #: A smoothing processor entry run before ``linear_quant`` (issue 17), or None.
    smoothing: dict[str, Any] | None = None
    #: ``spec.process`` written out (then ``qconfig`` and ``smoothing`` are not used), or None.
    process: tuple[dict[str, Any], ...] | None = None
    #: ``spec.prior`` stages.
    prior: tuple[dict[str, Any], ...] = ()
    #: Calibrate on these of the calibration samples only (indices), or on all of them (None).
    samples: tuple[int, ...] | None = None


SCHEMES: dict[str, Scheme] = {
    s.name: s
    for s in (
        # W8A8 static: the best practices use asymmetric per-tensor activations.
        Scheme("w8a8_asym", {"act": _act("per_tensor", False), "weight": _weight("int8")}, "W8A8"),
        Scheme("w8a8_sym", {"act": _act("per_tensor", True), "weight": _weight("int8")}, "W8A8"),
        Scheme(
            "w8a8_dynamic",
            {"act": _act("per_token", True), "weight": _weight("int8")},
            "W8A8_DYNAMIC",
        ),
        Scheme(
            "w4a8_dynamic",
            {"act": _act("per_token", True), "weight": _weight("int4")},
            "W4A8_DYNAMIC",
        ),
        # Per-group int4 weights exist in msModelSlim only for gptq (no per-group minmax), and its
        # W4A8_DYNAMIC fake-quant layer is per-channel only: the run is refused when deploying.
        Scheme(
            "w4a8_dynamic_g32",
            {
                "act": _act("per_token", True),
                "weight": _weight("int4", "per_group", "gptq", group_size=32),
            },
            "W4A8_DYNAMIC",
            refused="No implementation found for ABC",
        ),
    )
}
#: Smoothing before the dynamic and the static int8 schemes: ``<smoothing>-<scheme>``.
SMOOTHINGS: dict[str, dict[str, Any]] = {
    "iter_smooth": {"type": "iter_smooth", "alpha": 0.9, "scale_min": 1e-5, "symmetric": True},
    "flex_smooth": {"type": "flex_smooth_quant"},
    "flex_smooth_fixed": {"type": "flex_smooth_quant", "alpha": 0.6, "beta": 0.4},
    "smooth_quant": {"type": "smooth_quant", "alpha": 0.5, "symmetric": True},
    # msModelSlim's default adapter (--model_type default) finds norm -> linears only
    "iter_smooth_norm": {"type": "iter_smooth", "enable_subgraph_type": ["norm-linear"]},
    "flex_smooth_norm": {"type": "flex_smooth_quant", "enable_subgraph_type": ["norm-linear"]},
}
for _smoothing, _entry in SMOOTHINGS.items():
    for _base in ("w8a8_dynamic", "w8a8_asym"):
        _scheme = SCHEMES[_base]
        SCHEMES[f"{_smoothing}-{_base}"] = Scheme(
            f"{_smoothing}-{_base}", _scheme.qconfig, _scheme.quant_type, smoothing=_entry
        )
_DYNAMIC = {"type": "linear_quant", "qconfig": SCHEMES["w8a8_dynamic"].qconfig, "include": ["*"]}
#: Where one YAML could mean two things (issue 23): ``spec.prior`` stages and ``group``s.
for _scheme in (
    # msModelSlim reloads the weights after a prior stage: the export is w8a8_dynamic's
    Scheme("prior_iter_smooth-w8a8_dynamic", {}, "W8A8_DYNAMIC", process=(_DYNAMIC,),
           prior=({"process": [SMOOTHINGS["iter_smooth"]]},)),
    # a group of smoothing processors alone smooths
    Scheme("group_iter_smooth-w8a8_dynamic", {}, "W8A8_DYNAMIC",
           process=({"type": "group", "configs": [SMOOTHINGS["iter_smooth"]]}, _DYNAMIC)),
    Scheme("group_iter_flex-w8a8_dynamic", {}, "W8A8_DYNAMIC", process=(
        {"type": "group", "configs": [SMOOTHINGS["iter_smooth"], SMOOTHINGS["flex_smooth_fixed"]]},
        _DYNAMIC,
    )),
    # beside linear_quant in a group, msModelSlim skips the smoothing (msquant refuses)
    Scheme("group_iter_smooth_linear_quant-w8a8_dynamic", {}, "W8A8_DYNAMIC",
           process=({"type": "group", "configs": [SMOOTHINGS["iter_smooth"], _DYNAMIC]},)),
):  # fmt: skip
    SCHEMES[_scheme.name] = _scheme


#: The ``ssz`` weight method (tests/oracle/test_ssz_oracle.py): kept apart from :data:`SCHEMES`,
#: whose tests compare msModelSlim's weights with min/max ones.
SSZ_SCHEMES: dict[str, Scheme] = {
    s.name: s
    for s in (
        Scheme("w8a16_ssz", {"weight": _weight("int8", method="ssz")}, "W8A16"),
        Scheme(
            "w8a8_asym_ssz",
            {"act": _act("per_tensor", False), "weight": _weight("int8", method="ssz")},
            "W8A8",
        ),
        Scheme(
            "w8a8_dynamic_ssz",
            {"act": _act("per_token", True), "weight": _weight("int8", method="ssz")},
            "W8A8_DYNAMIC",
        ),
        Scheme(
            "w4a8_dynamic_ssz",
            {"act": _act("per_token", True), "weight": _weight("int4", method="ssz", step=10)},
            "W4A8_DYNAMIC",
        ),
    )
}


#: The int8 KV cache (``dynamic_cache``, C8) and ``pd_mix`` activations (W8A8_MIX), issue 25: the
#: reduced entries of ``qwen3-32b-dense-w8a8c8.yaml`` and ``minimax_m27_w8a8c8.yaml``.
_C8 = {
    "type": "dynamic_cache",
    "qconfig": {"scope": "per_channel", "dtype": "int8", "symmetric": True, "method": "minmax"},
    "include": ["*"],
}
_PD_MIX = {
    "type": "linear_quant",
    "qconfig": {"act": _act("pd_mix", False), "weight": _weight("int8")},
    "include": ["*"],
}
C8_SCHEMES: dict[str, Scheme] = {
    s.name: s
    for s in (
        Scheme("w8a8_dynamic_c8", {}, "W8A8_DYNAMIC", process=(_DYNAMIC, _C8)),
        # msModelSlim's per-channel observer keeps the last forward's range only: calibrated on
        # all samples, its KV scales are those of the last sample alone
        Scheme("w8a8_dynamic_c8_last", {}, "W8A8_DYNAMIC", process=(_DYNAMIC, _C8),
               samples=(CALIB_SAMPLES - 1,)),
        Scheme("pd_mix", {}, "W8A8_MIX", process=(_PD_MIX,)),
        Scheme("pd_mix_c8", {}, "W8A8_MIX", process=(_PD_MIX, _C8), samples=(0,)),
    )
}  # fmt: skip


#: ``float_sparse`` (W16A16S, issue 25): ``qwen3-32b-dense-w16a16s.yaml``'s entry.
SPARSE_SCHEMES: dict[str, Scheme] = {
    s.name: s
    for s in (
        Scheme("float_sparse", {}, "W16A16S", process=(
            {"type": "float_sparse", "sparse_ratio": 0.4, "include": ["*"], "exclude": []},
        )),
    )
}  # fmt: skip


#: ``flex_awq_ssz`` (issue 25) before W4A8_DYNAMIC ssz weights, as msModelSlim's W4A8 best
#: practices (DeepSeek-V3.2, GLM-5) write it: its ``qconfig`` is the one its search measures.
_AWQ_QCONFIG = SSZ_SCHEMES["w4a8_dynamic_ssz"].qconfig
AWQ_SMOOTHINGS: dict[str, dict[str, Any]] = {
    "flex_awq_ssz": {"type": "flex_awq_ssz", "qconfig": _AWQ_QCONFIG},
    "flex_awq_ssz_fixed": {"type": "flex_awq_ssz", "qconfig": _AWQ_QCONFIG, "alpha": 0.4},
    # the shipped practices' entry: up-down only, the first layer left out
    "flex_awq_ssz_updown": {
        "type": "flex_awq_ssz",
        "qconfig": _AWQ_QCONFIG,
        "enable_subgraph_type": ["up-down"],
        "include": ["*"],
        "exclude": ["model.layers.0.*"],
    },
    # the routed-experts practices' entry (DeepSeek-V3.2, GLM-5 / 5.1 W4A8): up-down, the dense
    # layer and the shared experts left out, so the routed experts' up -> down pairs are smoothed
    "flex_awq_ssz_experts": {
        "type": "flex_awq_ssz",
        "qconfig": _AWQ_QCONFIG,
        "enable_subgraph_type": ["up-down"],
        "include": ["*"],
        "exclude": ["model.layers.0.*", "*mlp.shared_experts.*"],
    },
    # int8 minmax weights in the search (W8A8_DYNAMIC), every type
    "flex_awq_minmax": {
        "type": "flex_awq_ssz",
        "qconfig": {"act": _act("per_token", True), "weight": _weight("int8")},
    },
}
for _smoothing, _entry in AWQ_SMOOTHINGS.items():
    for _base in (SSZ_SCHEMES["w4a8_dynamic_ssz"], SCHEMES["w8a8_dynamic"]):
        SSZ_SCHEMES[f"{_smoothing}-{_base.name}"] = Scheme(
            f"{_smoothing}-{_base.name}", _base.qconfig, _base.quant_type, smoothing=_entry
        )


#: ``flex_awq_ssz`` on routed MoE experts (issue 25), quantized as the DeepSeek-V3.2 and GLM-5 /
#: 5.1 W4A8 practices quantize: a group of W8A8_DYNAMIC (int8 minmax weights) for everything but
#: the routed experts and W4A8_DYNAMIC ssz for the experts (``*mlp.experts.*``).
_MOE_W4A8 = {
    "type": "group",
    "configs": [
        {
            "type": "linear_quant",
            "qconfig": SCHEMES["w8a8_dynamic"].qconfig,
            "include": ["*"],
            "exclude": ["*mlp.experts.*"],
        },
        {"type": "linear_quant", "qconfig": _AWQ_QCONFIG, "include": ["*mlp.experts.*"]},
    ],
}
MOE_SCHEMES: dict[str, Scheme] = {
    s.name: s
    for s in (
        Scheme("moe_w4a8", {}, "W8A8_DYNAMIC", process=(_MOE_W4A8,)),
        # the practices' entry: the routed experts' up -> down pairs
        Scheme("flex_awq_ssz_experts-moe_w4a8", {}, "W8A8_DYNAMIC",
               process=(AWQ_SMOOTHINGS["flex_awq_ssz_experts"], _MOE_W4A8)),
        # every up-down pair but the dense layer's: the shared experts' too
        Scheme("flex_awq_ssz_updown-moe_w4a8", {}, "W8A8_DYNAMIC",
               process=(AWQ_SMOOTHINGS["flex_awq_ssz_updown"], _MOE_W4A8)),
        # alpha given: the fold alone, on the routed experts
        Scheme("flex_awq_ssz_experts_fixed-moe_w4a8", {}, "W8A8_DYNAMIC",
               process=({**AWQ_SMOOTHINGS["flex_awq_ssz_experts"], "alpha": 0.4}, _MOE_W4A8)),
    )
}  # fmt: skip


def _mx(dtype: str, axes: bool = True) -> dict[str, Any]:
    """An MX ``per_block`` minmax config (``ext.axes: -1`` as the practices write it for act)."""
    config: dict[str, Any] = {
        "scope": "per_block",
        "dtype": dtype,
        "symmetric": True,
        "method": "minmax",
    }
    return {**config, "ext": {"axes": -1}} if axes else config


def _mx_entry(weight: str, act: str, include: list[str], **extra: Any) -> dict[str, Any]:
    qconfig = {"act": _mx(act), "weight": _mx(weight, axes=False)}
    return {"type": "linear_quant", "qconfig": qconfig, "include": include, **extra}


#: MX (issue 26): the entries of the shipped MXFP practices on the tiny Qwen3: all linears one
#: scheme, GLM-5.1's mix (attention W8A8_MXFP8, MLP W4A4_MXFP4, as a group) and W4A8_MXFP.
MX_SCHEMES: dict[str, Scheme] = {
    s.name: s
    for s in (
        Scheme("w8a8_mxfp8", {}, "W8A8_MXFP8", process=(_mx_entry("mxfp8", "mxfp8", ["*"]),)),
        Scheme("w4a4_mxfp4", {}, "W4A4_MXFP4", process=(
            # longcat's form: weight ext.axes written too
            {**_mx_entry("mxfp4", "mxfp4", ["*"]),
             "qconfig": {"act": _mx("mxfp4"), "weight": _mx("mxfp4")}},
        )),
        Scheme("w4a8_mxfp", {}, "W4A8_MXFP", process=(_mx_entry("mxfp4", "mxfp8", ["*"]),)),
        Scheme("mx_mixed", {}, "W4A4_MXFP4", process=({"type": "group", "configs": [
            _mx_entry("mxfp8", "mxfp8", ["*self_attn*"], exclude=["*o_proj"]),
            _mx_entry("mxfp4", "mxfp4", ["*mlp*"]),
        ]},)),
    )
}  # fmt: skip


#: W8A8 fp8 (issue 26): msModelSlim's ``WFP8AFP8_DYNAMIC`` (fp8_e4m3 per-channel weights, fp8_e4m3
#: per-token activations) on every linear, and on the MLP only (the others float).
_FP8_QCONFIG = {
    "act": {"scope": "per_token", "dtype": "fp8_e4m3", "symmetric": True, "method": "minmax"},
    "weight": {"scope": "per_channel", "dtype": "fp8_e4m3", "symmetric": True, "method": "minmax"},
}
FP8_SCHEMES: dict[str, Scheme] = {
    s.name: s
    for s in (
        Scheme("w8a8_fp8", {}, "WFP8AFP8_DYNAMIC", process=(
            {"type": "linear_quant", "qconfig": _FP8_QCONFIG, "include": ["*"]},
        )),
        Scheme("w8a8_fp8_mlp", {}, "WFP8AFP8_DYNAMIC", process=(
            {"type": "linear_quant", "qconfig": _FP8_QCONFIG, "include": ["*mlp*"]},
        )),
    )
}  # fmt: skip


#: W4A8_DYNAMIC ``ssz`` weights on the attention linears, and on every linear (issue 25): how
#: ``scale_bias`` is written for linears whose names are not those of Llama's attention and MLP
#: (DeepSeek's MLA ``q_a_proj`` / ``q_b_proj`` / ``kv_a_proj_with_mqa`` / ``kv_b_proj``).
_W4A8_SSZ_ATTENTION = {"type": "linear_quant", "qconfig": _AWQ_QCONFIG, "include": ["*self_attn*"]}
W4A8_NAME_SCHEMES: dict[str, Scheme] = {
    s.name: s
    for s in (
        Scheme("w4a8_ssz_attention", {}, "FLOAT", process=(_W4A8_SSZ_ATTENTION,)),
        Scheme("w4a8_ssz_all", {}, "FLOAT", process=(
            {"type": "linear_quant", "qconfig": _AWQ_QCONFIG, "include": ["*"]},
        )),
    )
}  # fmt: skip

#: The description types of the MX layers.
MX_QUANT_TYPES = ("W8A8_MXFP8", "W4A4_MXFP4", "W4A8_MXFP")


def all_schemes() -> dict[str, Scheme]:
    """Every scheme the oracle can run."""
    return {
        **SCHEMES, **SSZ_SCHEMES, **C8_SCHEMES, **SPARSE_SCHEMES, **MOE_SCHEMES,
        **W4A8_NAME_SCHEMES, **MX_SCHEMES, **FP8_SCHEMES,
    }  # fmt: skip


def config_for(scheme: Scheme, dataset: Path) -> dict[str, Any]:
    """The msModelSlim v1 config of ``scheme`` calibrating on ``dataset`` (an absolute path)."""
    return {
        "apiversion": "modelslim_v1",
        "metadata": {"config_id": f"oracle-{scheme.name}"},
        "spec": {
            **({"prior": [dict(stage) for stage in scheme.prior]} if scheme.prior else {}),
            "process": [dict(entry) for entry in scheme.process]
            if scheme.process is not None
            else ([scheme.smoothing] if scheme.smoothing else [])
            + [{"type": "linear_quant", "qconfig": scheme.qconfig, "include": ["*"]}],
            "save": [{"type": "ascendv1_saver", "part_file_size": 0}],
            "dataset": str(dataset),
        },
    }


def calibration_texts() -> list[str]:
    """The calibration samples: the first paragraphs of the test corpus."""
    text = (TESTS / "data" / "calib.txt").read_text(encoding="utf-8")
    paragraphs = [p.strip() for p in text.split("\n\n") if p.strip()]
    return paragraphs[:CALIB_SAMPLES]


def write_calibration(path: Path, samples: tuple[int, ...] | None = None) -> Path:
    """Write the calibration samples (those at ``samples``, or all) as msModelSlim's ``.jsonl``
    (``inputs_pretokenized``)."""
    texts = calibration_texts()
    chosen = texts if samples is None else [texts[i] for i in samples]
    lines = [json.dumps({"inputs_pretokenized": t}, ensure_ascii=False) for t in chosen]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def build_model(arch: str, folder: Path) -> Path:
    """The tiny float32 model of ``arch`` (2 layers, hidden 64), built once into ``folder``."""
    if (folder / "config.json").is_file():
        return folder
    import torch

    sys.path.insert(0, str(TESTS))
    from tiny_models import build_tiny_model

    params = {k: v for k, v in ARCHS[arch].items() if k not in _RUN_KEYS}
    dtype = getattr(torch, params.pop("dtype", "float32"))
    return build_tiny_model(folder, dtype=dtype, **params)


def run_msmodelslim(
    venv: Path,
    model: Path,
    config: Path,
    save: Path,
    log: Path,
    model_type: str = "default",
    python_path: Path | None = None,
) -> float:
    """Run ``msmodelslim quant`` on CPU; returns its wall time. Raises on a non-zero exit.

    :param python_path: a folder put on msModelSlim's ``PYTHONPATH`` (a test model adapter
        registered through its ``msmodelslim.model_adapter.plugins`` entry points).
    """
    # One thread, as msquant's side runs (tests/conftest.py): float sums split over threads
    # round differently, and a search that compares near-equal losses (flex_awq_ssz's alpha on
    # routed experts) can then pick another candidate on one side only.
    env = {**os.environ, **THREAD_ENV}
    if python_path is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(python_path), env.get("PYTHONPATH")]))
    command = [
        str(venv / "bin" / "msmodelslim"),
        "quant",
        "--model_type",
        model_type,
        "--model_path",
        str(model),
        "--save_path",
        str(save),
        "--device",
        "cpu",
        "--config_path",
        str(config),
        "--trust_remote_code",
        "False",
    ]
    start = time.monotonic()
    with log.open("w", encoding="utf-8") as out:
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, check=False, env=env)
    if done.returncode != 0:
        text = log.read_text(encoding="utf-8", errors="replace")
        errors = [line for line in text.splitlines() if " - ERROR - " in line][:5]
        summary = "\n".join(errors) if errors else text[-3000:]
        raise RuntimeError(f"msmodelslim exited {done.returncode} (log {log}):\n{summary}")
    return time.monotonic() - start


def require_venv(venv: Path) -> Path:
    """``venv`` when it holds msModelSlim; otherwise the test fails saying how to build it."""
    import pytest

    if not (venv / "bin" / "msmodelslim").is_file():
        pytest.fail(
            f"no msModelSlim environment at {venv}: run scripts/msmodelslim_env.sh (or set "
            "MSQUANT_MSMODELSLIM_VENV)"
        )
    return venv


def load_ascend_export(folder: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The tensors of the single weight shard of an Ascend export and its description."""
    from safetensors.torch import load_file

    (weights,) = folder.glob("quant_model_weights*.safetensors")
    description = json.loads((folder / "quant_model_description.json").read_text())
    return load_file(str(weights)), description


def export_dir(cache: Path, arch: str, scheme: str) -> Path:
    """Where the oracle export of (``arch``, ``scheme``) lives."""
    return cache / "exports" / f"{arch}-{scheme}"


def msquant_export(cache: Path, arch: str, scheme_name: str, save: Path) -> Path:
    """msquant's export of ``scheme_name`` on the tiny ``arch`` model (the config and model the
    oracle gave msModelSlim), run under the adapter name msModelSlim ran with (``--model_type``:
    it decides what a smoothing entry smooths), on one thread as msModelSlim ran
    (:data:`THREAD_ENV`; the test process already runs one, tests/conftest.py)."""
    import torch

    import msquant

    torch.set_num_threads(int(THREAD_ENV["OMP_NUM_THREADS"]))

    msquant.quantize(
        cache / "models" / arch,
        save,
        cache / "configs" / f"{scheme_name}.yaml",
        progress=False,
        model_type=str(
            ARCHS[arch].get("msquant_model_type", ARCHS[arch].get("model_type", "default"))
        ),
    )
    return save


def ensure_export(cache: Path, venv: Path, arch: str, scheme_name: str) -> Path:
    """The msModelSlim export of ``scheme_name`` on the tiny ``arch`` model, made if missing
    (or made under other thread settings than :data:`THREAD_ENV`: it is made again)."""
    save = export_dir(cache, arch, scheme_name)
    stamp = save.parent / f"{save.name}.threads.json"
    if (save / "quant_model_description.json").is_file():
        if stamp.is_file() and json.loads(stamp.read_text()) == THREAD_ENV:
            return save
        shutil.rmtree(save)
    cache.mkdir(parents=True, exist_ok=True)
    model = build_model(arch, cache / "models" / arch)
    scheme = all_schemes()[scheme_name]
    if scheme.samples is None:
        dataset = write_calibration(cache / "calib.jsonl")
    else:
        suffix = "-".join(str(i) for i in scheme.samples)
        dataset = write_calibration(cache / f"calib-{suffix}.jsonl", scheme.samples)
    config = cache / "configs" / f"{scheme_name}.yaml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(yaml.safe_dump(config_for(scheme, dataset)), encoding="utf-8")
    save.parent.mkdir(parents=True, exist_ok=True)
    model_type = ARCHS[arch].get("model_type", "default")
    log = save.parent / f"{save.name}.log"
    plugin = ARCHS[arch].get("plugin")
    python_path = HERE / str(plugin) if plugin else None
    seconds = run_msmodelslim(venv, model, config, save, log, model_type, python_path)
    stamp.write_text(json.dumps(THREAD_ENV), encoding="utf-8")
    logger.info("%s %s: msmodelslim ran in %.1f s -> %s", arch, scheme_name, seconds, save)
    return save


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--venv", type=Path, default=DEFAULT_VENV)
    exported = [
        name
        for name, scheme in all_schemes().items()
        if scheme.refused is None and not scheme.smoothing and scheme.process is None
    ]
    parser.add_argument("--scheme", nargs="*", default=exported, choices=list(all_schemes()))
    parser.add_argument("--arch", nargs="*", default=list(ARCHS), choices=list(ARCHS))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    failed = 0
    for arch in args.arch:
        for scheme in args.scheme:
            try:
                ensure_export(args.cache, args.venv, arch, scheme)
            except RuntimeError as exc:
                failed += 1
                logger.error("%s %s: %s", arch, scheme, exc)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
