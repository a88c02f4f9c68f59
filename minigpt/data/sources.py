"""Where training data comes from, by name: a dataset (TinyStories, downloaded and tokenized on
first use), text files, conversations (.jsonl, for chat fine-tuning), or a directory already
prepared. `resolve_data` turns any of them into a prepared directory and returns it;
`check_tokenizer` refuses data tokenized for another model; `prepare_in_job` does it once in a
multi-process job.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import minigpt.data.chats as chats
import minigpt.data.download as download
import minigpt.data.prepare as prepare
import minigpt.data.readers as readers
from minigpt import chat_template
from minigpt.config import ConfigError
from minigpt.data.corpus import SHARDS
from minigpt.data.preferences import prepare_preferences
from minigpt.data.prepare_source import (
    DEFAULT_VAL_FRACTION,
    PROGRESS,
    prepare_source,
    remove_shards,
)
from minigpt.data.prompts import prepare_prompts
from minigpt.data.shards import vocabulary_hash
from minigpt.data.token_files import SPLITS, DataError, load_meta, split_path
from minigpt.files import sha256
from minigpt.tokenizer import (
    DEFAULT_TOKENIZER,
    load_tokenizer,
    ranks_file,
    shipped_tokenizers,
)

DATASETS = {"tinystories": "v1", "tinystories-v1": "v1", "tinystories-v2": "v2"}
SMALL_TEXT = 8 << 20  # text files smaller than this are tokenized in this process (no pool)


def _tokenizer_suffix(tokenizer: str) -> str:
    """What a prepared directory's name gains for a tokenizer other than GPT-2's: its name, and
    for a file or folder of one's own (an imported vocabulary) the start of its hash, so two
    vocabularies never share a directory."""
    if tokenizer == DEFAULT_TOKENIZER:
        return ""
    folder = Path(tokenizer) / "tokenizer.json"
    if folder.is_file():
        return f"-{Path(tokenizer).name}-{sha256(folder)[:8]}"
    path = ranks_file(tokenizer)
    if path is None:
        return f"-{tokenizer}"
    if tokenizer in shipped_tokenizers():
        return f"-{path.stem}"
    return f"-{path.stem}-{sha256(path)[:8]}" if path.is_file() else f"-{path.stem}"


def prepare_tinystories(root: str | Path = "data", version: str = "v1", *,
                        base_url: str | None = None, revision: str | None = None,
                        tokenizer: str = DEFAULT_TOKENIZER, workers: int | None = None,
                        progress: bool = True) -> Path:
    """Download (once) and tokenize (once per tokenizer) TinyStories into shards in
    `root/tinystories[-v2][-<tokenizer>]/` (the downloaded text stays in the first), its
    validation file as the val split."""
    if version not in download.TINYSTORIES_FILES:
        raise DataError(f"unknown TinyStories version {version!r}: choose v1 or v2")
    revision = revision or download.TINYSTORIES_REVISION
    text_dir = Path(root) / ("tinystories" if version == "v1" else f"tinystories-{version}")
    out = text_dir.with_name(text_dir.name + _tokenizer_suffix(tokenizer))
    files = download.TINYSTORIES_FILES[version]
    paths = (text_dir / files["train"], text_dir / files["val"])
    if _prepared(out, {"dataset.revision": revision, "tokenizer": tokenizer},
                 list(zip(paths, SPLITS)), allow_deleted=True):
        return out
    urls = {split: download.hf_url(name, revision=revision, base_url=base_url)
            for split, name in files.items()}
    for split, name in files.items():
        size, sha256 = download.expected_file(name, revision)
        download.download_file(urls[split], text_dir / name, size=size, sha256=sha256,
                               progress=progress)
    _clear(out)
    prepare_source(readers.Source(f"tinystories-{version}", files=paths, splits=SPLITS,
                                  complete=True),
                   out, tokenizer=tokenizer, workers=workers, progress=progress,
                   dataset={"name": "tinystories", "version": version,
                            "repo": download.HF_REPO, "revision": revision, "urls": urls})
    return out


def prepare_text(files: Sequence[str | Path], root: str | Path = "data", *,
                 val_fraction: float | None = None, tokenizer: str = DEFAULT_TOKENIZER,
                 workers: int | None = None, progress: bool = True) -> Path:
    """Tokenize local text files into shards in `root/text-<hash of their contents>
    [-<tokenizer>]/`, `val_fraction` of their documents held out by the hash of their text
    (`minigpt.data.encoding.held_out`)."""
    paths = _text_files(files)
    val_fraction = DEFAULT_VAL_FRACTION if val_fraction is None else val_fraction
    combined = hashlib.sha256()
    for path in paths:
        combined.update(bytes.fromhex(sha256(path)))
    out = Path(root) / f"text-{combined.hexdigest()[:12]}{_tokenizer_suffix(tokenizer)}"
    if _prepared(out, {"tokenizer": tokenizer, "val_fraction": val_fraction},
                 [(path, "train+val") for path in paths]):
        return out
    _clear(out)
    if workers is None and sum(p.stat().st_size for p in paths) < SMALL_TEXT:
        workers = 1
    prepare_source(readers.Source(" ".join(map(str, paths)), files=tuple(paths)), out,
                   tokenizer=tokenizer, val_fraction=val_fraction, workers=workers,
                   progress=progress, dataset={"name": "text"})
    return out


def _prepared(out: Path, expected: dict[str, Any], inputs: list[tuple[Path, str]], *,
              allow_deleted: bool = False) -> bool:
    """Whether `out` already holds these files prepared with these settings: in shards, or in
    the one file a split that earlier versions wrote (kept and read as it is, so the runs
    trained on it resume on the very batches they would have read)."""
    if prepare.is_current(out, expected, inputs, allow_deleted=allow_deleted):
        return True
    try:
        meta = load_meta(out)
    except DataError:
        return False
    if meta.get("kind") != SHARDS or (out / PROGRESS).exists() or any(
            _dotted(meta, key) != value for key, value in expected.items()):
        return False
    if allow_deleted and not all(path.exists() for path, _ in inputs):
        return True  # the text may be deleted once tokenized
    identity = readers.Source("", files=tuple(p for p, _ in inputs),
                              splits=tuple(s for _, s in inputs if s in SPLITS)).identity()
    return meta.get("sources") == identity


def _dotted(meta: dict[str, Any], key: str) -> Any:
    found: Any = meta
    for part in key.split("."):
        found = found.get(part) if isinstance(found, dict) else None
    return found


def _clear(out: Path) -> None:
    """Remove a finished preparation of other files or settings from a cache folder (its token
    files, shards and meta.json; never the downloaded text beside them), so it is prepared
    again; an unfinished one is left for `prepare_source` to go on with."""
    if not (out / "meta.json").is_file():
        return
    remove_shards(out, progress_too=True)
    for split in SPLITS:  # the one-file layout's
        split_path(out, split).unlink(missing_ok=True)
    (out / "meta.json").unlink()


def _text_files(files: Sequence[str | Path]) -> list[Path]:
    paths = [Path(f) for f in files]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise DataError(f"no such file: {', '.join(missing)} (data is 'tinystories', "
                        f"'tinystories-v2', a prepared directory, or text files)")
    return paths


def resolve_data(data: str | Sequence[str], root: str | Path = "data",
                 tokenizer: str | None = None, *, seq_len: int = 0, truncate: bool = False,
                 template: str | None = None, objective: str = "lm",
                 max_completion: int = 0) -> Path:
    """A prepared directory (shards and meta.json) for a dataset name or text files.

    `"tinystories"` / `"tinystories-v2"` download and prepare into `root` on first use; a
    directory holding meta.json is used as it is (refused if a `tokenizer` is named and it used
    another); .jsonl files (or folders of them) are conversations, rendered with the
    tokenizer's chat template (or `template`, or ChatML: `minigpt.data.chats`) and packed
    into windows of `seq_len` (`truncate`: cut a longer one instead of refusing it); anything
    else is a list of text files. Text is tokenized with `tokenizer`, GPT-2's when None. For
    `objective` "dpo", .jsonl files are pairs (`minigpt.data.preferences`, windows of seq_len
    + 1); for "grpo", prompts (`minigpt.data.prompts`, leaving `max_completion` tokens).
    """
    items = [data] if isinstance(data, (str, os.PathLike)) else list(data)
    if not items:
        raise DataError("no data given: name a dataset (tinystories, tinystories-v2) or files")
    if objective != "lm":
        rendering, _ = chat_template.with_template(load_tokenizer(tokenizer), template)
        if objective == "dpo":
            return prepare_preferences(items, root, rendering, tokenizer, seq_len)
        return prepare_prompts(items, root, rendering, tokenizer, seq_len, max_completion)
    if chats.is_chats(items):
        if seq_len < 1:
            raise DataError("conversations are packed into windows: give their length (seq_len)")
        name = tokenizer or DEFAULT_TOKENIZER
        rendering, _ = chat_template.with_template(load_tokenizer(name), template)
        return chats.prepare_chats(items, root, rendering, name, seq_len, truncate=truncate)
    if len(items) == 1 and str(items[0]).lower() in DATASETS:
        return prepare_tinystories(root, DATASETS[str(items[0]).lower()],
                                   tokenizer=tokenizer or DEFAULT_TOKENIZER)
    if len(items) == 1 and (Path(items[0]) / "meta.json").is_file():
        meta = load_meta(items[0])
        used = meta.get("tokenizer", DEFAULT_TOKENIZER)
        recorded = meta.get("vocab_hash")  # shards name their vocabulary: its spelling may vary
        same = recorded is not None and tokenizer is not None and (
            recorded == vocabulary_hash(tokenizer))
        if tokenizer is not None and used != tokenizer and not same:
            again = ("prepare the corpus again into another folder with --tokenizer "
                     f"{tokenizer}" if meta.get("kind") == SHARDS else "give the text or the "
                     "dataset name instead and it is prepared again")
            raise DataError(f"{items[0]} was tokenized with {used!r}, not {tokenizer!r}: "
                            f"{again} (or, to train on it, choose a model with that tokenizer: "
                            f"--tokenizer {used})")
        if tokenizer is not None and recorded is not None and not same:
            raise DataError(f"{items[0]} was tokenized with a vocabulary named {used!r} whose "
                            f"ids meant other tokens (its vocabulary hash {recorded[:12]}, now "
                            f"{vocabulary_hash(tokenizer)[:12]}): prepare the corpus again "
                            f"with this one")
        return Path(items[0])
    if len(items) == 1 and (Path(items[0]) / "progress.json").is_file():
        raise DataError(f"{items[0]} is a corpus whose preparation did not finish: run the "
                        f"same `python -m minigpt.data prepare` command again to finish it")
    return prepare_text(items, root, tokenizer=tokenizer or DEFAULT_TOKENIZER)


def check_tokenizer(data_dir: str | Path, model_cfg, model_name: str) -> dict:
    """The meta.json of prepared data a model is to train on, refused (ConfigError) unless the
    data is in the model's tokenizer. A model's vocabulary may have rows its tokenizer never
    uses (imported checkpoints often do), so the tokenizer, not the vocabulary size, decides."""
    meta = load_meta(data_dir)
    if meta["vocab_size"] != load_tokenizer(model_cfg.tokenizer).n_vocab or meta.get(
            "vocab_hash") not in (None, vocabulary_hash(model_cfg.tokenizer)):
        raise ConfigError(
            f"{data_dir} was tokenized with {meta['tokenizer']!r} ({meta['vocab_size']:,} "
            f"tokens), but model {model_name!r} has a vocabulary of "
            f"{model_cfg.vocab_size:,} ({model_cfg.tokenizer!r}): give the text or dataset "
            f"name so it is prepared with the model's tokenizer, or pass --tokenizer "
            f"{meta['tokenizer']} to train a model with that one")
    return meta


def prepare_in_job(data: Sequence[str], root: str | Path, tokenizer: str, **options) -> Path:
    """`resolve_data` in a (possibly multi-process) job: process 0 prepares first and the others
    wait, then reuse its files (a shared file system) or prepare their own copy."""
    import jax
    from jax.experimental import multihost_utils

    if jax.process_count() == 1:
        return resolve_data(data, root, tokenizer=tokenizer, **options)
    data_dir = (resolve_data(data, root, tokenizer=tokenizer, **options)
                if jax.process_index() == 0 else None)
    multihost_utils.sync_global_devices("minigpt: data prepared by process 0")
    return data_dir or resolve_data(data, root, tokenizer=tokenizer, **options)


