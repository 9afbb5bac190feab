"""compressed-tensors ``pack-quantized`` checkpoints (vLLM, transformers)."""
