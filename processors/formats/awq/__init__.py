"""AWQ checkpoints (GEMM layout, AutoAWQ / llm-awq): 4-bit per-group ``qweight``/``qzeros``/``scales``."""
