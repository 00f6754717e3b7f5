"""GGUF targets in transformers: the loading arguments of a GGUF file, and the file parsed once
per load instead of three times (``gguf_parsed_once``). target/load.py loads them; ``spec`` is its
TargetSpec (not imported here: load.py imports this module)."""

from __future__ import annotations

import contextlib
import copy
import functools
from pathlib import Path


def gguf_kwargs(spec) -> dict:
    return {"gguf_file": spec.gguf_file} if spec.gguf_file else {}


def gguf_model_kwargs(spec) -> dict:
    """The model's GGUF arguments. transformers from about 5.24 keeps a GGUF's weights in their
    quantized blocks where a matmul kernel for them is installed, which the engine's static-cache
    forward and the CPU weight layout cannot use; ask for the plain dequantized model there."""
    kwargs = gguf_kwargs(spec)
    try:
        from transformers import GgufConfig
    except ImportError:  # older: GGUF weights are always dequantized on load
        return kwargs
    return dict(kwargs, quantization_config=GgufConfig(dequantize=True)) if kwargs else kwargs


@contextlib.contextmanager
def gguf_parsed_once(spec):
    """While loading a GGUF target, parse the file once instead of three times. For a spec
    that is not a GGUF file this does nothing.

    transformers reads the GGUF separately for the tokenizer, the config and the weights, and
    each read rebuilds a ``GGUFReader`` (tens of seconds of pure-Python field parsing for
    SmolLM2's 49k-token vocab) and, per tensor, a ``TensorNameMap``. Inside this context both
    are memoized: the reader per path (it only reads its memory map), the name map per
    (arch, layers), and the metadata-only read (tokenizer and config both ask for it). Same
    results; the default target loaded in 9.3 s instead of 23.8 s on a 2-core CPU
    (lab/experiments/gguf_load_and_chunked_prefill.py). Without the ``gguf`` package
    this does nothing."""
    if spec.gguf_file is None:
        yield
        return
    try:
        import gguf
    except ImportError:
        yield
        return
    original_reader, original_name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict = {}

    def shared_reader(path, mode="r"):
        key = (str(Path(path).resolve()), mode)
        if key not in readers:
            readers[key] = original_reader(path, mode)
        return readers[key]

    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    original_checkpoint = gguf_utils.load_gguf_checkpoint
    metadata: dict = {}

    def checkpoint_metadata_once(path, return_tensors=False, **kwargs):
        if return_tensors or kwargs:
            return original_checkpoint(path, return_tensors, **kwargs)
        key = str(Path(path).resolve())
        if key not in metadata:
            metadata[key] = original_checkpoint(path, False)
        return copy.deepcopy(metadata[key])  # callers pop keys from what they get

    gguf.GGUFReader = shared_reader
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(original_name_map)
    gguf_utils.load_gguf_checkpoint = checkpoint_metadata_once
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = original_reader, original_name_map
        gguf_utils.load_gguf_checkpoint = original_checkpoint


def quiet_gguf_progress() -> None:
    # transformers' per-tensor GGUF bar is carriage-return noise in a log file.
    from tqdm.auto import tqdm
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    gguf_utils.tqdm = functools.partial(tqdm, disable=True)
