"""Data: prepared token files found or made by name, and `python -m minigpt.data`.

The package's modules, in the order data flows: `download` (the TinyStories files, resumable and
verified), `stories` (how a text file splits into stories), `prepare` (stories to token files),
`token_files` (the prepared format and its meta.json), `loader` (Grain batches for training) and
`vocabulary` (training a new BPE vocabulary on stories).

`resolve_data("tinystories")` downloads and tokenizes the dataset on first use and returns its
directory; local text files are prepared the same way; a directory already holding meta.json is
used as it is.

    python -m minigpt.data prepare --dataset tinystories [--version v1|v2] [--out data/]
    python -m minigpt.data prepare --text FILE... [--val-fraction 0.1] [--out data/]
    (either with --tokenizer gpt2|tinystories-4k|FILE.tiktoken; default gpt2)
    python -m minigpt.data tokenizer --vocab-size N --text FILE... --out FILE.tiktoken
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from minigpt.config import ConfigError
from minigpt.data import download, prepare
from minigpt.data.token_files import DataError, load_meta
from minigpt.data.vocabulary import train_tokenizer
from minigpt.files import sha256
from minigpt.runtime import plain_warnings
from minigpt.tokenizer import (
    DEFAULT_TOKENIZER,
    TokenizerError,
    load_tokenizer,
    ranks_file,
    shipped_tokenizers,
)

DATASETS = {"tinystories": "v1", "tinystories-v1": "v1", "tinystories-v2": "v2"}


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
                        tokenizer: str = DEFAULT_TOKENIZER, progress: bool = True) -> Path:
    """Download (once) and tokenize (once per tokenizer) TinyStories into
    `root/tinystories[-v2][-<tokenizer>]/` (the downloaded text stays in the first)."""
    if version not in download.TINYSTORIES_FILES:
        raise DataError(f"unknown TinyStories version {version!r}: choose v1 or v2")
    revision = revision or download.TINYSTORIES_REVISION
    text_dir = Path(root) / ("tinystories" if version == "v1" else f"tinystories-{version}")
    out = text_dir.with_name(text_dir.name + _tokenizer_suffix(tokenizer))
    files = download.TINYSTORIES_FILES[version]
    sources = [(text_dir / files["train"], "train"), (text_dir / files["val"], "val")]
    expected = {"dataset.revision": revision, "tokenizer": tokenizer}
    if prepare.is_current(out, expected, sources, allow_deleted=True):
        return out
    urls = {split: download.hf_url(name, revision=revision, base_url=base_url)
            for split, name in files.items()}
    for split, name in files.items():
        size, sha256 = download.expected_file(name, revision)
        download.download_file(urls[split], text_dir / name, size=size, sha256=sha256,
                               progress=progress)
    prepare.prepare(
        out, [text_dir / files["train"]], val_files=[text_dir / files["val"]], complete=True,
        tokenizer=tokenizer,
        dataset={"name": "tinystories", "version": version, "repo": download.HF_REPO,
                 "revision": revision, "urls": urls},
        progress=progress)
    return out


def prepare_text(files: Sequence[str | Path], root: str | Path = "data", *,
                 val_fraction: float | None = None, tokenizer: str = DEFAULT_TOKENIZER,
                 progress: bool = True) -> Path:
    """Tokenize local text files into `root/text-<hash of their contents>[-<tokenizer>]/`."""
    paths = _text_files(files)
    combined = hashlib.sha256()
    for path in paths:
        combined.update(bytes.fromhex(sha256(path)))
    out = Path(root) / f"text-{combined.hexdigest()[:12]}{_tokenizer_suffix(tokenizer)}"
    prepare.prepare(out, paths, progress=progress, tokenizer=tokenizer,
                        val_fraction=(prepare.DEFAULT_VAL_FRACTION if val_fraction is None
                                      else val_fraction),
                        dataset={"name": "text", "files": [str(p.resolve()) for p in paths]})
    return out


def _text_files(files: Sequence[str | Path]) -> list[Path]:
    paths = [Path(f) for f in files]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise DataError(f"no such file: {', '.join(missing)} (data is 'tinystories', "
                        f"'tinystories-v2', a prepared directory, or text files)")
    return paths


def resolve_data(data: str | Sequence[str], root: str | Path = "data",
                 tokenizer: str | None = None) -> Path:
    """A prepared directory (train.bin, val.bin, meta.json) for a dataset name or text files.

    `"tinystories"` / `"tinystories-v2"` download and prepare into `root` on first use; a
    directory holding meta.json is used as it is (refused if a `tokenizer` is named and it used
    another); anything else is a list of text files. Text is tokenized with `tokenizer`, GPT-2's
    when None.
    """
    items = [data] if isinstance(data, (str, os.PathLike)) else list(data)
    if not items:
        raise DataError("no data given: name a dataset (tinystories, tinystories-v2) or files")
    if len(items) == 1 and str(items[0]).lower() in DATASETS:
        return prepare_tinystories(root, DATASETS[str(items[0]).lower()],
                                   tokenizer=tokenizer or DEFAULT_TOKENIZER)
    if len(items) == 1 and (Path(items[0]) / "meta.json").is_file():
        used = load_meta(items[0]).get("tokenizer", DEFAULT_TOKENIZER)
        if tokenizer is not None and used != tokenizer:
            raise DataError(f"{items[0]} was tokenized with {used!r}, not {tokenizer!r}: give "
                            f"the text or the dataset name instead and it is prepared again "
                            f"(or, to train on it, choose a model with that tokenizer: "
                            f"--tokenizer {used})")
        return Path(items[0])
    return prepare_text(items, root, tokenizer=tokenizer or DEFAULT_TOKENIZER)


def check_tokenizer(data_dir: str | Path, model_cfg, model_name: str) -> dict:
    """The meta.json of prepared data a model is to train on, refused (ConfigError) unless the
    data is in the model's tokenizer. A model's vocabulary may have rows its tokenizer never
    uses (imported checkpoints often do), so the tokenizer, not the vocabulary size, decides."""
    meta = load_meta(data_dir)
    if meta["vocab_size"] != load_tokenizer(model_cfg.tokenizer).n_vocab:
        raise ConfigError(
            f"{data_dir} was tokenized with {meta['tokenizer']!r} ({meta['vocab_size']:,} "
            f"tokens), but model {model_name!r} has a vocabulary of "
            f"{model_cfg.vocab_size:,} ({model_cfg.tokenizer!r}): give the text or dataset "
            f"name so it is prepared with the model's tokenizer, or pass --tokenizer "
            f"{meta['tokenizer']} to train a model with that one")
    return meta


def prepare_in_job(data: Sequence[str], root: str | Path, tokenizer: str) -> Path:
    """`resolve_data` in a (possibly multi-process) job: process 0 prepares first and the others
    wait, then reuse its files (a shared file system) or prepare their own copy."""
    import jax
    from jax.experimental import multihost_utils

    if jax.process_count() == 1:
        return resolve_data(data, root, tokenizer=tokenizer)
    data_dir = resolve_data(data, root, tokenizer=tokenizer) if jax.process_index() == 0 else None
    multihost_utils.sync_global_devices("minigpt: data prepared by process 0")
    return data_dir or resolve_data(data, root, tokenizer=tokenizer)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minigpt.data", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    prep = commands.add_parser("prepare", help="download and/or tokenize a dataset once")
    source = prep.add_mutually_exclusive_group(required=True)
    source.add_argument("--dataset", choices=["tinystories"], help="an official dataset")
    source.add_argument("--text", nargs="+", metavar="FILE",
                        help="local text: stories separated by <|endoftext|> lines or blank lines")
    prep.add_argument("--version", choices=["v1", "v2"], default="v1",
                      help="TinyStories v1 (GPT-3.5 + GPT-4) or v2 (GPT-4 only)")
    prep.add_argument("--val-fraction", type=float, default=None,
                      help="share of local-text stories held out for validation (default 0.1)")
    prep.add_argument("--tokenizer", default=DEFAULT_TOKENIZER,
                      help="gpt2 (default), tinystories-4k, or a .tiktoken ranks file")
    prep.add_argument("--out", default="data", help="root directory (default: data)")
    bpe = commands.add_parser("tokenizer", help="train a BPE vocabulary on stories "
                                                "(needs the optional trainer: .[bpe])")
    bpe.add_argument("--vocab-size", type=int, required=True,
                     help="tokens in all, <|endoftext|> included")
    bpe.add_argument("--text", nargs="+", metavar="FILE", required=True)
    bpe.add_argument("--out", required=True, metavar="FILE.tiktoken")
    args = parser.parse_args(argv)
    if args.command == "prepare" and args.dataset and args.val_fraction is not None:
        parser.error("--val-fraction applies to --text; TinyStories has a validation file")
    try:
        with plain_warnings():
            if args.command == "tokenizer":
                return _train_command(args)
            load_tokenizer(args.tokenizer)  # a bad name fails before any download
            if args.dataset:
                out = prepare_tinystories(args.out, args.version, tokenizer=args.tokenizer)
            else:
                out = prepare_text(args.text, args.out, val_fraction=args.val_fraction,
                                   tokenizer=args.tokenizer)
            meta = load_meta(out)
    except (DataError, TokenizerError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: run the same command again to resume", file=sys.stderr)
        return 130
    print(f"{out}: train {meta['train_tokens']:,} tokens ({meta['train_stories']:,} stories), "
          f"val {meta['val_tokens']:,} tokens ({meta['val_stories']:,} stories), "
          f"tokenizer {meta['tokenizer']}")
    return 0


def _train_command(args: argparse.Namespace) -> int:
    if not args.out.endswith(".tiktoken"):
        raise DataError(f"--out {args.out}: name the ranks file FILE.tiktoken")
    provenance = train_tokenizer(args.text, args.vocab_size, args.out)
    enc = load_tokenizer(str(Path(args.out).resolve()))
    text_bytes = sum(Path(f).stat().st_size for f in args.text)
    tokens = sum(len(enc.encode_ordinary(Path(f).read_text(encoding="utf-8")))
                 for f in args.text)
    print(f"{args.out}: {provenance['vocab_size']:,} tokens; {text_bytes / tokens:.2f} bytes "
          f"per token on the training text; provenance in {Path(args.out).with_suffix('.json')}")
    return 0
