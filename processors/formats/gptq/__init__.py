"""GPTQ checkpoints (GPTQModel / AutoGPTQ layout): ``qweight``/``qzeros``/``scales``/``g_idx``."""
