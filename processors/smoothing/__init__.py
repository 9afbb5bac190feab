"""The smoothing processors (``smooth_quant``, ``iter_smooth``, ``flex_smooth_quant``): per-channel
scales from calibration statistics folded into a decoder layer's norms and linears before
``linear_quant`` quantizes it (docs/smoothing.md)."""
