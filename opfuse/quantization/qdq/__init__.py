"""The QDQ model every step reads: ONNX Runtime's quantiser behind one call (:mod:`.quantizer`),
the one index of its quantised layers (:mod:`.layers`), and output SQNR (:mod:`.sqnr`)."""
