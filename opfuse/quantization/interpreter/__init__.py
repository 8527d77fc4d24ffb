"""ONNX nodes as torch functions: the QDQ graph run (and differentiated) in torch, for the
algorithms that fit roundings and scales (:mod:`.program`)."""
