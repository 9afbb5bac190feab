"""``fa3_quant``: msModelSlim's attention activation quantization (FA3, the "C8" of its practices)."""
