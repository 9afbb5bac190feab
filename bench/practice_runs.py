"""Run msModelSlim's configs on tiny models of their architecture families: ``msquant quant``
with the config unchanged (only the calibration data is replaced, by a tiny local text file
and a small ``--max_calib_tokens``, or for the vision-language archs of :data:`IMAGE_ARCHS` by
a ``calibImages`` folder of random images beside the config), then ``msquant verify`` on the
export.

Used by ``bench/msmodelslim_configs.py --run``. A config's family comes from its folder in
msModelSlim's ``lab_practice`` (``qwen3_moe/...`` -> Qwen3-MoE); each family is a random-weight
transformers model with a tiny trained tokenizer, built by ``tests/tiny_models.py``. The
verdict's ``msquant verify`` reads the export back on its own (layout, checksums, unpacking);
``msquant verify --model_path`` (each tensor against the float model) is reported beside it, as
smoothing and rotation legitimately change norms and weights (it then names the first one). Every run
is a separate ``python -m msquant`` process, so a crash is reported as the exception's last line
and the next config still runs.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
from tiny_models import (  # noqa: E402
    CORPUS,
    build_tiny_model,
    build_tiny_vlm,
    build_tiny_vlm_with_processor,
    write_calibration_images,
)

#: Exit status of ``msquant`` for bad input (a clear refusal, not a crash).
EXIT_INPUT = 2

#: lab_practice folder -> (tiny model name, ``build_tiny_model`` arguments). Families whose model
#: transformers has are built as that class; the others use the closest one (said in the name).
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "default": ("Llama", dict(arch="llama")),
    # head_dim 32 (hidden 128, 4 heads): QwQ's quarot block_size 32 must divide it
    "qwq": ("Qwen2 (QwQ's class), head_dim 32", dict(arch="qwen2", hidden_size=128)),
    "qwen3": ("Qwen3", dict(arch="qwen3")),
    "qwen3_moe": ("Qwen3-MoE", dict(arch="qwen3_moe")),
    "qwen3_next": ("Qwen3-Next", dict(arch="qwen3_next")),
    "deepseek_v3": ("DeepSeek-V3", dict(arch="deepseek_v3")),
    "deepseek_v3_2": ("DeepSeek-V3 (for V3.2)", dict(arch="deepseek_v3")),
    # v_head_dim 32: V4's quarot block_size 32 must divide the per-head value rotation's width
    # (qk_nope_head_dim 24 makes the keys as wide, which transformers' tiny DeepSeek-V3 needs)
    "deepseek_v4": (
        "DeepSeek-V3 (for V4), v_head_dim 32",
        dict(arch="deepseek_v3", v_head_dim=32, qk_nope_head_dim=24, head_dim=8),
    ),
    "kimi_k2": ("DeepSeek-V3 (Kimi-K2's class)", dict(arch="deepseek_v3")),
    "glm4_moe": ("GLM-4-MoE", dict(arch="glm4_moe")),
    "minimax_m2": ("MiniMax-M2", dict(arch="minimax_m2", intermediate_size=32)),
}
FAMILIES["glm_5"] = ("GLM-4-MoE (for GLM-5)", FAMILIES["glm4_moe"][1])
#: Files needing a model other than their family's: the DeepSeek-V3 ``w4a8c8`` files rotate with
#: quarot block_size 32 (v_head_dim 32, as V4's) and exclude layers 0-2 from fa3_quant (4 layers:
#: layer 3's MLA gets FA3 scales). The W4A8 file of DeepSeek-V3.2 smooths the routed experts of
#: layers 3 on with ``flex_awq_ssz`` (4 layers, the first dense). The four GLM-5 / 5.1 files that
#: need more than the GLM-4-MoE stand-in run on a 6-layer tiny GLM-5 (``glm_moe_dsa``, layers
#: 0-2 dense, its DSA indexer read by fa3_quant): ``flex_awq_ssz`` smooths layers 3-5's experts,
#: and fa3_quant (layers 0-4 excluded) quantizes layer 5's indexer.
FILE_MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    **{
        f"deepseek_v3/{name}": (
            "DeepSeek-V3, v_head_dim 32, 4 layers",
            dict(FAMILIES["deepseek_v4"][1], num_layers=4),
        )
        for name in ("deepseekr1_w4a8c8_per_channel.yaml", "deepseekv3_w4a8c8_per_channel.yaml")
    },
    "deepseek_v3_2/deepseek_w4a8.yaml": (
        "DeepSeek-V3 (for V3.2), 4 layers",
        dict(FAMILIES["deepseek_v3_2"][1], num_layers=4),
    ),
    **{
        f"glm_5/{name}": ("GLM-5 (glm_moe_dsa), 6 layers", dict(arch="glm_moe_dsa", num_layers=6))
        for name in (
            "glm_5_w4a8.yaml",
            "glm_5_1_w4a8.yaml",
            "glm_5_1_w4a8c8.yaml",
            "glm_5_1_w8a8c8.yaml",
        )
    },
}

#: lab_practice folder of ``multimodal_vlm_modelslim_v1`` configs -> (tiny model name,
#: :data:`tiny_models.VLM_ARCHS` key): transformers' image-text-to-text classes.
VLM_FAMILIES: dict[str, tuple[str, str]] = {
    "qwen2_5_vl": ("Qwen2.5-VL", "qwen2_5_vl"),
    "qwen3_vl": ("Qwen3-VL", "qwen3_vl"),
    "qwen3_vl_moe": ("Qwen3-VL-MoE", "qwen3_vl_moe"),
    "qwen3_5_moe": ("Qwen3.5-MoE", "qwen3_5_moe"),
    "internvl3_5": ("InternVL (transformers' class, Qwen3 text)", "internvl"),
    "internvl3_5_moe": ("InternVL (transformers' class, Qwen3 text)", "internvl"),
    "kimi_k2_5": ("Kimi-K2.5", "kimi_k25"),
    "glm4_6v": ("GLM-4.xV-MoE", "glm4v_moe"),
    # the whole Omni checkpoint (thinker, talker, speech decoder); msquant quantizes the thinker
    "qwen2_5_omni_thinker": ("Qwen2.5-Omni", "qwen2_5_omni"),
    "qwen3_omni_moe": ("Qwen3-Omni-MoE", "qwen3_omni_moe"),
}
#: The VLM archs whose tiny model is built with its processor and calibrated on images (a
#: ``calibImages`` folder of random images beside the config, ``default_text`` with each), as
#: their practices' ``dataset: calibImages`` asks; the others calibrate on the text corpus.
IMAGE_ARCHS = frozenset({"qwen3_vl", "qwen3_vl_moe", "internvl", "glm4v_moe"})
#: The dense files of the ``qwen3_5_moe`` folder (Qwen3.5 / 3.6 dense models).
VLM_FILES: dict[str, tuple[str, str]] = {
    name: ("Qwen3.5 (dense)", "qwen3_5")
    for name in ("qwen3_5_dense_w8a8.yaml", "qwen3_6_27B_w8a8.yaml", "qwen3_6_dense_w8a8.yaml")
}


@dataclass(frozen=True)
class RunRow:
    """One config run: the model used, the verdict and its detail, the seconds it took, and
    what ``msquant verify --model_path`` (each tensor against the float model) says."""

    file: str
    model: str
    verdict: str
    detail: str
    seconds: float
    against_original: str = ""


def family_of(name: str) -> str:
    """The ``lab_practice`` folder of a config file name (``.../qwen3_moe/x.yaml`` -> qwen3_moe)."""
    return Path(name).parent.name


def vlm_family(name: str) -> tuple[str, str] | None:
    """(tiny model name, VLM arch) of a vision-language config file, None for the others."""
    return VLM_FILES.get(Path(name).name) or VLM_FAMILIES.get(family_of(name))


def build_family_model(family: str, directory: Path, name: str = "") -> str:
    """Write the tiny model of ``family`` (of the file ``name``: the vision-language ones by
    file) into ``directory``; returns the model's name."""
    vlm = vlm_family(name) if name else None
    if vlm is not None and vlm[1] in IMAGE_ARCHS:
        build_tiny_vlm_with_processor(directory, vlm[1])
        write_calibration_images(directory.parent / "calibImages")
        return f"{vlm[0]}, images"
    if vlm is not None:
        build_tiny_vlm(directory, vlm[1])
        return vlm[0]
    label, params = FILE_MODELS.get(f"{family}/{Path(name).name}", FAMILIES[family])
    build_tiny_model(directory, **params)
    return label


def last_line(text: str) -> str:
    """The last non-empty line (an exception's message, or the CLI's error line)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def cli_error(text: str) -> str:
    """The ``msquant: error: ...`` line of the CLI's output (empty when there is none)."""
    return next((ln.strip() for ln in text.splitlines() if ln.startswith("msquant: error:")), "")


def first_error(text: str) -> str:
    """The first ``- ...`` finding of a ``msquant verify`` report (else its last line)."""
    for line in text.splitlines():
        if line.strip().startswith("- "):
            return line.strip()[2:]
    return last_line(text)


def msquant_cli(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """``python -m msquant ARGS`` in a fresh process, output captured."""
    return subprocess.run(
        [sys.executable, "-m", "msquant", *args], capture_output=True, text=True,
        timeout=timeout, check=False,
    )  # fmt: skip


def run_config(
    name: str, text: str, workdir: Path, max_calib_tokens: int = 32, timeout: float = 600
) -> RunRow:
    """Quantize the family's tiny model with the config ``text`` unchanged, then verify."""
    start = time.monotonic()
    family = family_of(name)
    if family not in FAMILIES and vlm_family(name) is None:
        return RunRow(name, "-", "not run", f"no tiny model for family {family!r}", 0.0)
    case = workdir / Path(name).stem
    shutil.rmtree(case, ignore_errors=True)  # a previous run's model and export
    case.mkdir(parents=True)
    config = case / Path(name).name
    config.write_text(text, encoding="utf-8")
    try:
        label = build_family_model(family, case / "model", name)
    except Exception as exc:  # a tiny model transformers cannot build: say so, run the rest
        return RunRow(name, family, "not run", f"model build: {exc!r}"[:300], 0.0)
    save = case / "export"
    vlm = vlm_family(name)
    calibration = (
        []  # the config's calibImages, the images written beside it
        if vlm is not None and vlm[1] in IMAGE_ARCHS
        else ["--calib_path", str(CORPUS), "--max_calib_tokens", str(max_calib_tokens)]
    )
    quant = msquant_cli(
        "quant", "--model_path", str(case / "model"), "--save_path", str(save),
        "--config_path", str(config), *calibration, "--no_progress", timeout=timeout,
    )  # fmt: skip
    (case / "quant.log").write_text(quant.stdout + quant.stderr, encoding="utf-8")
    if quant.returncode == EXIT_INPUT:
        detail = f"{cli_error(quant.stderr)} {first_error(quant.stderr)}".strip()
        return RunRow(name, label, "refused", detail, time.monotonic() - start)
    if quant.returncode != 0:
        return RunRow(
            name, label, f"crashed (exit {quant.returncode})", last_line(quant.stderr),
            time.monotonic() - start,
        )  # fmt: skip
    verify = msquant_cli("verify", str(save), timeout=timeout)
    seconds = time.monotonic() - start
    versus = msquant_cli("verify", str(save), "--model_path", str(case / "model"), timeout=timeout)
    against = "ok" if versus.returncode == 0 else first_error(versus.stdout + versus.stderr)
    if verify.returncode != 0:
        detail = first_error(verify.stdout + verify.stderr)
        return RunRow(name, label, f"exported, verify failed (exit {verify.returncode})", detail,
                      seconds, against)  # fmt: skip
    return RunRow(name, label, "exported+verified", "", seconds, against)


def run_configs(files: list[tuple[str, str]], workdir: Path | None = None) -> list[RunRow]:
    """``run_config`` on every ``(name, text)``, in a temporary folder unless ``workdir``."""
    if workdir is not None:
        return [run_config(name, text, workdir) for name, text in files]
    with tempfile.TemporaryDirectory(prefix="msquant-run-") as tmp:
        return [run_config(name, text, Path(tmp)) for name, text in files]


def render_runs(rows: list[RunRow], markdown: bool) -> str:
    """The table: file, model used, verdict, detail, seconds."""
    header = ["file", "tiny model", "verdict", "message", "seconds", "verify --model_path"]
    body = [[r.file, r.model, r.verdict, r.detail, f"{r.seconds:.1f}", r.against_original]
            for r in rows]  # fmt: skip
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in body]
        return "\n".join(lines)
    return "\n".join("\t".join(row) for row in [header, *body])
