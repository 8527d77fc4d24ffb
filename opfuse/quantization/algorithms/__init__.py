"""The quantisation algorithms a preset composes as steps: activation ranges, weight ranges,
bias correction, AdaRound, block reconstruction, the mixed-precision search."""
