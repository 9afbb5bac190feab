"""Quantization numerics and the schemas that describe them (no model walking here)."""
