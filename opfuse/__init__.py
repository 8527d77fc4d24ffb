"""opfuse: an operator-fusion optimiser for neural-network inference."""
__version__ = "0.1.0"
