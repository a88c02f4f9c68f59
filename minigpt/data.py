"""Data preparation: prepared token files found or made by name, and `python -m minigpt.data`.

`resolve_data("tinystories")` downloads (`minigpt.download`) and tokenizes (`minigpt.pretokenize`)
the dataset on first use and returns its directory; local text files are prepared the same way; a
directory already holding meta.json is used as it is. The format of what lands on disk is
`minigpt.tokens`; reading it in batches is `minigpt.loader`.

    python -m minigpt.data prepare --dataset tinystories [--version v1|v2] [--out data/]
    python -m minigpt.data prepare --text FILE... [--val-fraction 0.1] [--out data/]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from minigpt import download, pretokenize
from minigpt.tokenizer import TokenizerError
from minigpt.tokens import DataError, load_meta, token_file_problem

DATASETS = {"tinystories": "v1", "tinystories-v1": "v1", "tinystories-v2": "v2"}


def prepare_tinystories(root: str | Path = "data", version: str = "v1", *,
                        base_url: str | None = None, revision: str | None = None,
                        progress: bool = True) -> Path:
    """Download (once) and tokenize (once) TinyStories into `root/tinystories[-v2]/`."""
    if version not in download.TINYSTORIES_FILES:
        raise DataError(f"unknown TinyStories version {version!r}: choose v1 or v2")
    revision = revision or download.TINYSTORIES_REVISION
    out = Path(root) / ("tinystories" if version == "v1" else f"tinystories-{version}")
    if _still_prepared(out, revision):
        return out
    files = download.TINYSTORIES_FILES[version]
    urls = {split: download.hf_url(name, revision=revision, base_url=base_url)
            for split, name in files.items()}
    for split, name in files.items():
        size, sha256 = download.expected_file(name, revision)
        download.download_file(urls[split], out / name, size=size, sha256=sha256,
                               progress=progress)
    pretokenize.prepare(
        out, [out / files["train"]], val_files=[out / files["val"]], complete=True,
        dataset={"name": "tinystories", "version": version, "repo": download.HF_REPO,
                 "revision": revision, "urls": urls},
        progress=progress)
    return out


def _still_prepared(out: Path, revision: str) -> bool:
    """Token files of this revision are complete and no source changed since (deleted is fine:
    a user may remove the 2 GB text once tokenized)."""
    try:
        meta = load_meta(out)
    except DataError:
        return False
    if (meta.get("dataset") or {}).get("revision") != revision:
        return False
    if token_file_problem(out, meta):
        return False
    for source in meta["sources"]:
        path = out / source["file"]
        if path.exists() and (path.stat().st_size, path.stat().st_mtime_ns) != (
                source["bytes"], source["mtime_ns"]):
            return False
    return True


def prepare_text(files: Sequence[str | Path], root: str | Path = "data", *,
                 val_fraction: float | None = None, progress: bool = True) -> Path:
    """Tokenize local text files into `root/text-<hash of their contents>/`."""
    paths = [Path(f) for f in files]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise DataError(f"no such file: {', '.join(missing)} (data is 'tinystories', "
                        f"'tinystories-v2', a prepared directory, or text files)")
    combined = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            combined.update(hashlib.file_digest(f, "sha256").digest())
    out = Path(root) / f"text-{combined.hexdigest()[:12]}"
    pretokenize.prepare(out, paths, progress=progress,
                        val_fraction=(pretokenize.DEFAULT_VAL_FRACTION if val_fraction is None
                                      else val_fraction),
                        dataset={"name": "text", "files": [str(p.resolve()) for p in paths]})
    return out


def resolve_data(data: str | Sequence[str], root: str | Path = "data") -> Path:
    """A prepared directory (train.bin, val.bin, meta.json) for a dataset name or text files.

    `"tinystories"` / `"tinystories-v2"` download and prepare into `root` on first use; a
    directory holding meta.json is used as it is; anything else is a list of text files.
    """
    items = [data] if isinstance(data, (str, os.PathLike)) else list(data)
    if not items:
        raise DataError("no data given: name a dataset (tinystories, tinystories-v2) or files")
    if len(items) == 1 and str(items[0]).lower() in DATASETS:
        return prepare_tinystories(root, DATASETS[str(items[0]).lower()])
    if len(items) == 1 and (Path(items[0]) / "meta.json").is_file():
        return Path(items[0])
    return prepare_text(items, root)


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
    prep.add_argument("--out", default="data", help="root directory (default: data)")
    args = parser.parse_args(argv)
    if args.dataset and args.val_fraction is not None:
        parser.error("--val-fraction applies to --text; TinyStories has a validation file")
    try:
        if args.dataset:
            out = prepare_tinystories(args.out, args.version)
        else:
            out = prepare_text(args.text, args.out, val_fraction=args.val_fraction)
        meta = load_meta(out)
    except (DataError, TokenizerError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: run the same command again to resume", file=sys.stderr)
        return 130
    print(f"{out}: train {meta['train_tokens']:,} tokens ({meta['train_stories']:,} stories), "
          f"val {meta['val_tokens']:,} tokens ({meta['val_stories']:,} stories), "
          f"tokenizer {meta['tokenizer']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
