"""Perplexity of a float model or of an msquant export on a local text file (``msquant eval``).

What is measured: the text file's samples (read like calibration files: ``.txt``, ``.jsonl``,
``.json``) are joined with blank lines and tokenized once; the token stream is cut into windows of
``seqlen`` tokens starting every ``stride`` tokens (default: ``stride = seqlen``, non-overlapping).
Each token is scored once, by the window where it first appears after the window's first token
(the Hugging Face sliding-window recipe): a window overlapping the previous one scores only its
new tokens, using the overlap as context. The perplexity is ``exp(total NLL / scored tokens)``,
the NLL summed in float64 over natural-log token probabilities.

Exports are read back through the dequantizing readers of :mod:`msquant.verify` (written from the
format specifications, independently of the savers): the float model is built from the export's
``config.json``, its float tensors are loaded as stored, and each quantized linear gets its
dequantized weight ``(codes - offset) * scale`` cast to the model dtype. What is evaluated is thus
exactly what a consumer that dequantizes the checkpoint computes, not msquant's in-memory result.

``msquant quant --eval_data`` measures the same perplexity on the run's in-memory quantized model
(:mod:`~msquant.evaluate.run_evaluation`), which the run has just verified to be identical to its
export; both paths share :func:`~msquant.evaluate.windows.measure_perplexity`.
"""
