#!/usr/bin/env bash
# Build the opt-in environment for the transformers + optimum + gptqmodel consumer tests
# (tests/consumers/test_transformers_gptq.py, pytest marker `gptqmodel`).
#
# gptqmodel 7.7 needs torch >= 2.14, so this is a separate virtual environment from the normal test
# one (torch 2.13 CPU). PyPI's torch 2.14.1 is a CUDA build (about 5.5 GB with its nvidia-* wheels);
# it runs on the CPU. msquant itself is installed editable, so the tests make their exports there.
#
# Usage: scripts/consumer_env.sh [VENV_DIR]    (default: $MSQUANT_GPTQ_VENV or ~/.cache/msquant/gptq-venv)
# Then:  VENV_DIR/bin/python -m pytest -m gptqmodel tests/consumers
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${1:-${MSQUANT_GPTQ_VENV:-$HOME/.cache/msquant/gptq-venv}}"

python3 -m venv "$venv"
"$venv/bin/pip" install -q torch==2.14.1
"$venv/bin/pip" install -q gptqmodel==7.7.0 optimum==2.3.0 transformers==5.24.0
"$venv/bin/pip" install -q -e "$repo[test]"
"$venv/bin/python" -c "import gptqmodel, optimum, torch, transformers; print('torch', torch.__version__, 'gptqmodel', gptqmodel.__version__, 'optimum', optimum.__version__ if hasattr(optimum, '__version__') else '?', 'transformers', transformers.__version__)"
echo "consumer environment ready: $venv"
