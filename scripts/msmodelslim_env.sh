#!/usr/bin/env bash
# Build the opt-in environment of the msModelSlim oracle (tests/oracle, pytest marker `msmodelslim`).
#
# msModelSlim 26.1.0 runs its v1 pipeline on CPU. It is installed from the package registry into its
# own virtual environment, outside the repository, and only ever run as its CLI (`msmodelslim quant`)
# by tests/oracle/msmodelslim_run.py; msquant never imports it. torch is installed first so that pip
# takes the CPU wheel; msModelSlim does not declare torch, transformers, safetensors or pyyaml.
#
# Usage: scripts/msmodelslim_env.sh [VENV_DIR [TRANSFORMERS_VERSION]]   (default: $MSQUANT_MSMODELSLIM_VENV
#        or ~/.cache/msquant/msmodelslim-venv, transformers 5.24.0)
# Then:  MSQUANT_MSMODELSLIM_VENV=VENV_DIR python -m pytest -m msmodelslim tests/oracle
# The MoE rotation oracle needs a second one with transformers 4.57.6 (msModelSlim's Qwen3-MoE
# rotation addresses per-expert modules, which transformers 5 fuses):
#        scripts/msmodelslim_env.sh ~/.cache/msquant/msmodelslim-tf4-venv 4.57.6
#        (read from $MSQUANT_MSMODELSLIM_TF4_VENV, default that folder)
set -euo pipefail

venv="${1:-${MSQUANT_MSMODELSLIM_VENV:-$HOME/.cache/msquant/msmodelslim-venv}}"
transformers="${2:-5.24.0}"

python3 -m venv "$venv"
"$venv/bin/pip" install -q torch==2.13.0
"$venv/bin/pip" install -q msmodelslim==26.1.0 "transformers==$transformers" pydantic pyyaml safetensors accelerate
"$venv/bin/msmodelslim" --help > /dev/null
"$venv/bin/python" -c "import importlib.metadata as m; print('msmodelslim', m.version('msmodelslim'), 'torch', m.version('torch'), 'transformers', m.version('transformers'))"
echo "msModelSlim environment ready: $venv"
