"""Measuring what fusion buys: ``opfuse bench``, which measures and presents.

``opfuse bench`` reproduces the chapter's ResNet-50 table (section 4 of the source notes)
for any model. This package measures and presents; what it counts and predicts comes from
the optimiser's side (:mod:`opfuse.cost.traffic`, the memory-traffic rule;
:mod:`opfuse.cost.accelerator`, the cost model with its hardware profiles).

    options.py   the command's parser, defaults and validation       (light: read at start-up)
    run.py       :func:`run_bench`: every configuration applied, measured, counted, predicted
    measure.py   ONNX Runtime CPU latency: one session per variant, interleaved rounds,
                 an A/A control, node counts, kernel time per op type        (measurements)
    int8.py      the int8 rows: the model quantised with BN folded (opfuse quantize) and
                 unfolded (ONNX Runtime's quantize_static), with their SQNR
    result.py    the result rows and their JSON schema
    chapter.py   the chapter's own table and its modelled Conv+ReLU row
    table.py     the tables (rich); plot.py the figures (matplotlib, an optional extra)

Measured and predicted numbers are kept apart everywhere, and predictions say so.
"""
