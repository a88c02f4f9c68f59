"""Data: prepared token files found or made by name, and `python -m minigpt.data`.

The package's modules, in the order data flows: `download` (the TinyStories files, resumable and
verified), `stories` (how a text file splits into stories), `prepare` (stories to token files),
`chats` (conversations for chat fine-tuning, packed into windows), `sources` (data by name:
`resolve_data`), `token_files` (the prepared format and its meta.json), `documents` (where each
window's documents lie), `loader` (Grain batches for training), `vocabulary` (training a new BPE
vocabulary on stories) and `cli` (`python -m minigpt.data`).

`resolve_data("tinystories")` downloads and tokenizes the dataset on first use and returns its
directory; local text files and conversations are prepared the same way; a directory already
holding meta.json is used as it is.
"""

from __future__ import annotations

from minigpt.data import download, prepare
from minigpt.data.cli import main
from minigpt.data.sources import (
    DATASETS,
    check_tokenizer,
    prepare_in_job,
    prepare_text,
    prepare_tinystories,
    resolve_data,
)
from minigpt.data.token_files import DataError, load_meta

__all__ = ["DATASETS", "DataError", "check_tokenizer", "download", "load_meta", "main",
           "prepare", "prepare_in_job", "prepare_text", "prepare_tinystories", "resolve_data"]
