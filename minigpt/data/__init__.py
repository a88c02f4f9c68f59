"""Data: prepared folders found or made by name, and `python -m minigpt.data`.

The package's modules, in the order data flows: `download` (the TinyStories files, resumable and
verified), `stories` (how a text file splits into stories), `readers` (any source's documents in
resumable tasks), `encoding` (tokenizing them on every core), `shards` (the shard file),
`prepare_source` (any source into shards: TinyStories, text files and corpora alike), `chats`
(conversations for chat fine-tuning, packed into windows), `sources` (data by name:
`resolve_data`), `corpus` (a prepared folder of either layout, opened for reading),
`token_files` and `prepare` (the one-file layout of earlier versions, still read), `order`,
`documents` (where each window's documents lie), `loader` (Grain batches for training),
`vocabulary` (training a new BPE vocabulary on stories) and `cli` (`python -m minigpt.data`).

`resolve_data("tinystories")` downloads and tokenizes the dataset on first use and returns its
directory; local text files and conversations are prepared the same way; a directory already
holding meta.json is used as it is.
"""

from __future__ import annotations

import importlib

# Public name -> the module that defines it. Loaded when first used, so that a worker process
# tokenizing a corpus (`minigpt.data.encoding`) imports neither the command line nor JAX.
_PUBLIC = {
    "download": None, "prepare": None,
    "main": "minigpt.data.cli",
    "DATASETS": "minigpt.data.sources", "check_tokenizer": "minigpt.data.sources",
    "prepare_in_job": "minigpt.data.sources", "prepare_text": "minigpt.data.sources",
    "prepare_tinystories": "minigpt.data.sources", "resolve_data": "minigpt.data.sources",
    "DataError": "minigpt.data.token_files", "load_meta": "minigpt.data.token_files",
    "prepare_source": "minigpt.data.prepare_source", "open_corpus": "minigpt.data.corpus",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'minigpt.data' has no attribute {name!r}")
    module = importlib.import_module(_PUBLIC[name] or f"minigpt.data.{name}")
    return module if _PUBLIC[name] is None else getattr(module, name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
