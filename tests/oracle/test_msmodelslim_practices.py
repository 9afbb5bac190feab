"""msModelSlim 26.1.0's v1 best practices run on tiny models of their families (opt-in:
``pytest -m practices tests/oracle/test_msmodelslim_practices.py``).

``bench/msmodelslim_configs.py --run`` validates every ``modelslim_v1`` config of the wheel and
runs each valid one, unchanged except the calibration data, through ``msquant quant`` and
``msquant verify`` on a random-weight transformers model of its architecture family. The wheel is
``$MSQUANT_MSMODELSLIM_WHEEL``, else the one in ``~/.cache/msquant/msmodelslim`` (downloaded there
with ``pip download --no-deps`` when absent: the reason this suite is opt-in). About 3 minutes on
2 CPU cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.practices

BENCH = Path(__file__).resolve().parents[2] / "bench"

#: The configs exported and verified on 2026-12-02 (docs/msmodelslim-compat.md, "Run on tiny
#: models"; all 17 valid ones since quarot covers MoE and MLA layers); each must keep passing.
#: Add a config here when it starts to pass. The two W8A8C8 practices (``dynamic_cache``, one with
#: ``pd_mix``) pass since branch ``c8`` (2026-12-07).
PASSING = {
    "minimax_m2/minimax_m27_w8a8c8.yaml",
    "qwen3/qwen3-32b-dense-w8a8c8.yaml",
    "deepseek_v3/deepseek_w4a8_per_channel.yaml",
    # fa3_quant (2026-12-07): the DeepSeek-V3 ones on a 4-layer tiny model (FA3 on layer 3)
    "deepseek_v3/deepseekr1_w4a8c8_per_channel.yaml",
    "deepseek_v3/deepseekv3_w4a8c8_per_channel.yaml",
    "glm_5/glm_5_1_w8a8c8.yaml",
    # flex_awq_ssz on routed experts (2026-12-07), on 4-layer stand-ins (bench FILE_MODELS)
    "deepseek_v3_2/deepseek_w4a8.yaml",
    "glm_5/glm_5_w4a8.yaml",
    "glm_5/glm_5_1_w4a8.yaml",
    "glm_5/glm_5_1_w4a8c8.yaml",
    "deepseek_v3_2/deepseek_w8a8.yaml",
    "deepseek_v3_2/deepseek_w8a8_quarot.yaml",
    "deepseek_v4/deepseek_v4_flash_w8a8.yaml",
    "deepseek_v4/deepseek_v4_pro_w8a8.yaml",
    "default/default-w8a16.yaml",
    "default/default-w8a8.yaml",
    "glm4_moe/glm4_7_moe-w8a8-v1.yaml",
    "glm_5/glm_5_1_w8a8.yaml",
    "glm_5/glm_5_w8a8.yaml",
    "kimi_k2/kimi_w8a8_quarot.yaml",
    "minimax_m2/minimax_m27_w8a8.yaml",
    "qwen3_moe/qwen3-235B-w4a8-v1.yaml",
    "qwen3_moe/qwen3-30b-w4a8-v1.yaml",
    "qwen3_moe/qwen3-coder-480b-w4a8.yaml",
    "qwen3_next/qwen3-next-80b-a3b-w8a8.yaml",
    "qwq/qwq-32b-w8a8.yaml",
}

#: The configs that validate on 2026-12-02: the run covers all of them. The four W4A8 practices
#: with ``flex_awq_ssz`` validate since 2026-12-03: those excluding the dense layers are refused
#: on the tiny models (``flex_awq_ssz: no subgraph to smooth``: msquant does not smooth routed
#: experts), ``deepseek_v4_pro_w4a8`` exported there (its verify step not yet measured). The two
#: W8A8C8 practices validate since branch ``c8``.
VALID = {
    "minimax_m2/minimax_m27_w8a8c8.yaml",
    "qwen3/qwen3-32b-dense-w8a8c8.yaml",
    "deepseek_v3/deepseek_w4a8_per_channel.yaml",
    # fa3_quant since 2026-12-07; glm_5_1_w4a8c8 is refused on the tiny model as glm_5_1_w4a8
    "deepseek_v3/deepseekr1_w4a8c8_per_channel.yaml",
    "deepseek_v3/deepseekv3_w4a8c8_per_channel.yaml",
    "glm_5/glm_5_1_w4a8c8.yaml",
    "glm_5/glm_5_1_w8a8c8.yaml",
    "deepseek_v3_2/deepseek_w4a8.yaml",
    "deepseek_v4/deepseek_v4_pro_w4a8.yaml",
    "glm_5/glm_5_1_w4a8.yaml",
    "glm_5/glm_5_w4a8.yaml",
    "deepseek_v3_2/deepseek_w8a8.yaml",
    "deepseek_v3_2/deepseek_w8a8_quarot.yaml",
    "deepseek_v4/deepseek_v4_flash_w8a8.yaml",
    "deepseek_v4/deepseek_v4_pro_w8a8.yaml",
    "default/default-w8a16.yaml",
    "default/default-w8a8.yaml",
    "glm4_moe/glm4_7_moe-w8a8-v1.yaml",
    "glm_5/glm_5_1_w8a8.yaml",
    "glm_5/glm_5_w8a8.yaml",
    "kimi_k2/kimi_w8a8_quarot.yaml",
    "minimax_m2/minimax_m27_w8a8.yaml",
    "qwen3_moe/qwen3-235B-w4a8-v1.yaml",
    "qwen3_moe/qwen3-30b-w4a8-v1.yaml",
    "qwen3_moe/qwen3-coder-480b-w4a8.yaml",
    "qwen3_next/qwen3-next-80b-a3b-w8a8.yaml",
    "qwq/qwq-32b-w8a8.yaml",
}


def wheel() -> Path:
    """The msModelSlim 26.1.0 wheel: ``$MSQUANT_MSMODELSLIM_WHEEL`` or the bench script's cache."""
    given = os.environ.get("MSQUANT_MSMODELSLIM_WHEEL")
    if given:
        return Path(given)
    sys.path.insert(0, str(BENCH))
    from msmodelslim_configs import DEFAULT_CACHE, VERSION, wheel_path

    return wheel_path(DEFAULT_CACHE, VERSION)


def test_best_practices_that_pass_keep_passing(tmp_path: Path) -> None:
    """Every valid v1 best practice is run; those in :data:`PASSING` export and verify, the
    others end in msquant's own error message (a refusal or a verify finding), never a crash."""
    runs_json = tmp_path / "runs.json"
    subprocess.run(
        [sys.executable, str(BENCH / "msmodelslim_configs.py"), "--wheel", str(wheel()),
         "--apiversion", "modelslim_v1", "--run", "--run_dir", str(tmp_path / "runs"),
         "--run_json", str(runs_json)],
        capture_output=True, text=True, check=True, timeout=1800,
    )  # fmt: skip
    runs = {r["file"]: r for r in json.loads(runs_json.read_text())}
    assert set(runs) == VALID
    verified = {name for name, r in runs.items() if r["verdict"] == "exported+verified"}
    assert PASSING <= verified, {name: runs[name] for name in PASSING - verified}
    crashed = {name: r["detail"] for name, r in runs.items() if r["verdict"].startswith("crash")}
    assert not crashed
    for name in VALID - verified:
        assert runs[name]["detail"], f"{name}: {runs[name]['verdict']} without a message"
