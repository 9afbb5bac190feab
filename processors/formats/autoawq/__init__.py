"""AutoAWQ checkpoints (GEMM layout, AutoAWQ / llm-awq; ``quant_method: awq``): 4-bit per-group
``qweight``/``qzeros``/``scales``. Named ``autoawq`` after the layout's origin, so that ``awq``
stays free for the AWQ algorithm."""
