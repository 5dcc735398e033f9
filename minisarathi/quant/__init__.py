"""Quantized weights: the internal layouts the kernels read, and the conversions onto them
(docs/quantization.md)."""
