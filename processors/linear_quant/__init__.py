"""``linear_quant``: quantizes the linear layers of each decoder layer (weights by a method such as
``minmax`` or ``gptq``, activations by calibration) and records what the savers export."""
