"""Measuring what fusion buys: latency on ONNX Runtime, memory traffic, and an accelerator cost model."""
