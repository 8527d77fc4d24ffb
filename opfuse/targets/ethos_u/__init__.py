"""Arm Ethos-U (U55, U65, U85): int8 TFLite in NHWC, compiled by Arm's Vela.

The target's lowering (the folded, quantised ONNX graph written as int8 TFLite) and its
device code (Vela as the compiler, LiteRT's interpreter as the runner) sit in this package.
"""
