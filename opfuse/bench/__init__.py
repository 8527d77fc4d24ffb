"""Measuring what fusion buys: latency on ONNX Runtime, memory traffic, and an accelerator cost model.

``opfuse bench`` reproduces the chapter's ResNet-50 table (section 4 of the source notes)
for any model, in three independent parts, one module each:

    traffic.py    exact bytes each node reads and writes, from shape inference; the ideal
                  lower bound; traffic per layer                       (analysis, no running)
    measure.py    ONNX Runtime CPU latency: one session per variant, interleaved rounds,
                  an A/A control, node counts, kernel time per op type       (measurements)
    costmodel.py  roofline + launch overhead per kernel with on-chip buffer spills, from a
                  hardware profile (../hardware/*.toml); the ``--hardware`` fusion veto
                                                                     (a model's predictions)
    command.py    the ``opfuse bench`` command and :func:`run_bench`; table.py and plot.py
                  render its result

Measured and predicted numbers are kept apart everywhere, and predictions say so.
"""
