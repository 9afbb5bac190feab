#!/usr/bin/env python
"""Build the SmolLM2-135M-Instruct Hugging Face folder, fully offline: ``scripts/prepare_model.py
--model smollm2-135m-instruct`` under its first name (the README's first command).

Usage::

    python scripts/prepare_smollm2.py models/SmolLM2-135M-Instruct [--dtype float32|bfloat16] [--force]

Exit codes: 0 success, 1 internal failure (including a failed verification), 2 user error.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from prepare_model import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(model="smollm2-135m-instruct"))
