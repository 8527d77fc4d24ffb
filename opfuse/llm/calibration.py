"""Calibration text for the calibrated int4 algorithm (GPTQ): English that ships with every Python and is
not the text the accuracy benchmark evaluates on.

What it gives:

- :func:`text`: the docstrings of :data:`MODULES` (standard-library modules) and of their public classes
  and functions, in a fixed order. ``benchmarks/llm_accuracy.py`` measures perplexity on
  ``pydoc_data.topics`` (the language reference), which this text does not contain.
- :func:`windows`: ``count`` consecutive windows of ``length`` tokens of it, by a transformers tokenizer,
  without special tokens.
- :func:`feeds`: the exported graph's inputs for one prefill of each window from an empty cache
  (the names :func:`opfuse.llm.export.io_names` gives, past of length 0).

Legality: data only; nothing here changes a graph.
"""

from __future__ import annotations

__all__ = ["MODULES", "feeds", "text", "windows"]

import importlib
import inspect
import warnings

import numpy as np

MODULES = ("argparse", "collections", "csv", "datetime", "decimal", "email.message", "functools", "http.client",
           "itertools", "json", "logging", "os", "pathlib", "random", "re", "shutil", "sqlite3", "statistics",
           "string", "subprocess", "textwrap", "threading", "typing", "unittest", "urllib.request", "zipfile")


def text() -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # typing.io and typing.re are deprecated attributes
        return _text()


def _text() -> str:
    parts = []
    for name in MODULES:
        module = importlib.import_module(name)
        parts.append(inspect.getdoc(module) or "")
        for attr in sorted(dir(module)):
            obj = getattr(module, attr, None)
            if attr.startswith("_") or not (inspect.isclass(obj) or inspect.isfunction(obj)):
                continue
            if getattr(obj, "__module__", None) != module.__name__:
                continue
            doc = inspect.getdoc(obj)
            if doc and len(doc) > 80:
                parts.append(doc)
    return "\n\n".join(p for p in parts if p)


def windows(tokenizer, count: int = 8, length: int = 256) -> list[list[int]]:
    ids = tokenizer(text(), add_special_tokens=False)["input_ids"]
    return [ids[i * length:(i + 1) * length] for i in range(min(count, len(ids) // length))]


def feeds(shape: tuple[int, int, int], token_windows: list[list[int]]) -> list[dict]:
    """``shape``: (layers, kv heads, head size) of the decoder (:func:`opfuse.llm.export._shape`)."""
    from opfuse.llm.export import io_names  # (its heavy imports (torch, the pipeline): only when used)

    layers, kv_heads, head_size = shape
    past = io_names(layers)[0][3:]
    out = []
    for ids in token_windows:
        n = len(ids)
        feed = {"input_ids": np.array([ids], np.int64), "attention_mask": np.ones((1, n), np.int64),
                "position_ids": np.arange(n, dtype=np.int64)[None]}
        feed.update({p: np.zeros((1, kv_heads, 0, head_size), np.float32) for p in past})
        out.append(feed)
    return out
