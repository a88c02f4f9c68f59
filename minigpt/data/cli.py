"""`python -m minigpt.data`: prepare a dataset or any corpus, look inside a prepared folder or
check its shards' bytes, train a vocabulary, or show what chat fine-tuning trains on.

    python -m minigpt.data prepare --dataset tinystories [--version v1|v2] [--out data/]
    python -m minigpt.data prepare --text FILE... [--val-fraction 0.1] [--out data/]
    python -m minigpt.data prepare --source PATH|GLOB|hf:NAME[:CONFIG][@REVISION] --out DIR
        [--text-field text] [--shard-tokens N] [--workers N] [--val-fraction 0.1]
    (each with --tokenizer gpt2|tinystories-4k|FILE.tiktoken|FOLDER; default gpt2)
    python -m minigpt.data inspect DIR [--json] [--doc N]
    python -m minigpt.data verify DIR
    python -m minigpt.data tokenizer --vocab-size N --text FILE... --out FILE.tiktoken
    python -m minigpt.data sft --run RUN --data chats.jsonl [--show N] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import minigpt.data.chats as chats
from minigpt import chat_template
from minigpt.data.corpus import describe, open_corpus, verify
from minigpt.data.prepare_source import DEFAULT_SHARD_TOKENS, DEFAULT_VAL_FRACTION, prepare_source
from minigpt.data.sources import prepare_text, prepare_tinystories
from minigpt.data.token_files import DataError, load_meta
from minigpt.data.vocabulary import train_tokenizer
from minigpt.errors import exit_code
from minigpt.runtime import plain_warnings
from minigpt.tokenizer import DEFAULT_TOKENIZER, load_tokenizer


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "prepare" and args.dataset and args.val_fraction is not None:
        parser.error("--val-fraction applies to --text; TinyStories has a validation file")
    if args.command == "prepare" and args.source and args.out is None:
        parser.error("--source needs --out DIR: the folder its shards are written to")
    try:
        with plain_warnings():
            return exit_code(lambda: _command(args))
    except KeyboardInterrupt:
        print("interrupted: run the same command again to resume", file=sys.stderr)
        return 130


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m minigpt.data", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    prep = commands.add_parser("prepare", help="download and/or tokenize a dataset once")
    source = prep.add_mutually_exclusive_group(required=True)
    source.add_argument("--dataset", choices=["tinystories"], help="an official dataset")
    source.add_argument("--text", nargs="+", metavar="FILE",
                        help="local text: stories separated by <|endoftext|> lines or blank lines")
    source.add_argument("--source", metavar="PATH|GLOB|hf:NAME",
                        help="any corpus, into shards: .jsonl, .parquet or text files, a folder "
                             "or glob of them, or a Hugging Face dataset (hf:NAME[:CONFIG]"
                             "[@REVISION], needs .[datasets]); needs --out DIR")
    prep.add_argument("--version", choices=["v1", "v2"], default="v1",
                      help="TinyStories v1 (GPT-3.5 + GPT-4) or v2 (GPT-4 only)")
    prep.add_argument("--val-fraction", type=float, default=None,
                      help="share of the documents held out for validation (default 0.1): "
                           "--text holds out every 10th, --source those whose text hashes low")
    prep.add_argument("--text-field", default="text",
                      help="--source: the JSON field or parquet column holding the text")
    prep.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS,
                      help=f"--source: tokens a shard (default {DEFAULT_SHARD_TOKENS:,})")
    prep.add_argument("--workers", type=int, default=None,
                      help="--source: processes tokenizing (default: every core)")
    prep.add_argument("--tokenizer", default=DEFAULT_TOKENIZER,
                      help="gpt2 (default), tinystories-4k, or a .tiktoken ranks file")
    prep.add_argument("--out", default=None,
                      help="root directory (default: data); with --source, the corpus's folder")
    check = commands.add_parser("verify", help="check every shard of a prepared folder "
                                               "against the checksums its meta.json records")
    check.add_argument("folder", metavar="DIR")
    look = commands.add_parser("inspect", help="what a prepared folder holds: tokenizer, "
                                               "counts, shards, a document's ids")
    look.add_argument("folder", metavar="DIR")
    look.add_argument("--json", action="store_true", help="print it as one JSON object")
    look.add_argument("--doc", type=int, metavar="N",
                      help="add document N (from 0, in source order): its split and ids")
    bpe = commands.add_parser("tokenizer", help="train a BPE vocabulary on stories "
                                                "(needs the optional trainer: .[bpe])")
    bpe.add_argument("--vocab-size", type=int, required=True,
                     help="tokens in all, <|endoftext|> included")
    bpe.add_argument("--text", nargs="+", metavar="FILE", required=True)
    bpe.add_argument("--out", required=True, metavar="FILE.tiktoken")
    sft = commands.add_parser("sft", help="show what chat fine-tuning trains on: conversations "
                                          "with their trained tokens marked")
    sft.add_argument("--run", required=True, help="the run to fine-tune (its tokenizer and "
                                                  "chat template render the conversations)")
    sft.add_argument("--data", nargs="+", required=True, metavar="FILE.jsonl",
                     help='conversations: {"messages": [...]} per line, or folders of such files')
    sft.add_argument("--show", type=int, default=2, metavar="N",
                     help="conversations to print, trained text marked (default 2)")
    sft.add_argument("--json", action="store_true",
                     help='print every conversation as {"ids": [...], "loss_mask": [...]} '
                          "instead, one per line")
    return parser


def _command(args: argparse.Namespace) -> int:
    if args.command == "tokenizer":
        return _train_command(args)
    if args.command == "sft":
        return _sft_command(args)
    if args.command == "inspect":
        return _inspect_command(args)
    if args.command == "verify":
        return _verify_command(args)
    load_tokenizer(args.tokenizer)  # a bad name fails before any download
    if args.source:
        return _source_command(args)
    if args.dataset:
        out = prepare_tinystories(args.out or "data", args.version, tokenizer=args.tokenizer,
                                  workers=args.workers)
    else:
        out = prepare_text(args.text, args.out or "data", val_fraction=args.val_fraction,
                           tokenizer=args.tokenizer, workers=args.workers)
    _summary(out, load_meta(out))
    return 0


def _source_command(args: argparse.Namespace) -> int:
    meta = prepare_source(args.source, args.out, tokenizer=args.tokenizer,
                          text_field=args.text_field, shard_tokens=args.shard_tokens,
                          val_fraction=(DEFAULT_VAL_FRACTION if args.val_fraction is None
                                        else args.val_fraction), workers=args.workers)
    _summary(args.out, meta)
    return 0


def _summary(out, meta: dict) -> None:
    """One line: each split's tokens and documents (and shards), and the tokenizer."""
    def split(name: str) -> str:
        documents = meta.get(f"{name}_documents", meta.get(f"{name}_stories"))
        shards = len(meta["splits"][name]["shards"]) if "splits" in meta else None
        return (f"{name} {meta[f'{name}_tokens']:,} tokens ({documents:,} documents"
                + (f", {shards} shard{'s' * (shards != 1)})" if shards is not None else ")"))

    print(f"{out}: {split('train')}, {split('val')}, tokenizer {meta['tokenizer']}")


def _verify_command(args: argparse.Namespace) -> int:
    corpus = open_corpus(args.folder)  # the headers and counts first
    checked, problems = verify(corpus)
    if problems:
        raise DataError(f"{problems[0]}" + (f" (and {len(problems) - 1} more)"
                                            if len(problems) > 1 else "")
                        + f": prepare {args.folder} again")
    if not checked:
        print(f"{args.folder}: its headers and counts agree; it keeps no checksums (prepared "
              f"before they were kept, or a folder of the one-file layout), so its tokens "
              f"cannot be checked")
        return 0
    print(f"{args.folder}: {checked} shard{'s' * (checked != 1)} match their checksums")
    return 0


def _inspect_command(args: argparse.Namespace) -> int:
    corpus = open_corpus(args.folder)
    found = describe(corpus)
    if args.doc is not None:
        found["doc"] = corpus.document(args.doc)
    lines = [json.dumps(found)] if args.json else [
        f"{found['path']}: {found['tokens']:,} tokens, {found['documents']:,} documents, "
        f"tokenizer {found['tokenizer']} ({found['dtype']}), {found['layout']}"]
    for split, counts in ({} if args.json else found["splits"]).items():
        files = sum(s["split"] == split for s in found["shards"])
        lines.append(f"  {split}: {counts['tokens']:,} tokens, {counts['documents']:,} "
                     f"documents, {files} file{'s' * (files != 1)}")
    if args.doc is not None and not args.json:
        doc = found["doc"]
        lines.append(f"document {doc['number']} ({doc['split']}, {doc['tokens']} tokens): "
                     f"{doc['ids']}")
    try:
        print("\n".join(lines))
        sys.stdout.flush()
    except BrokenPipeError:
        _reader_gone()
    return 0


def _reader_gone() -> None:
    """`| head`: the reader has what it wanted. What is still buffered for it goes nowhere, so
    that Python's flush at exit does not fail with a second BrokenPipeError."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


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


def _sft_command(args: argparse.Namespace) -> int:
    """Render, tokenize and mask the conversations as `--init-from RUN --data ...` would."""
    from minigpt.runs import RunDir  # here: the data commands need neither JAX nor the models

    saved = RunDir(args.run).read()
    tokenizer, defaulted = chat_template.with_template(load_tokenizer(saved.model.tokenizer),
                                               saved.record.get("chat_template"))
    max_chars = saved.model.context_len * chat_template.CHARS_PER_TOKEN
    files, shown = chats.chat_files(args.data), 0
    if not files:
        raise DataError(f"{', '.join(args.data)} holds no conversations (.jsonl or .json files)")
    try:
        for path in files:
            for where, messages in chats.read_conversations(path):
                conversation = chats.encode(tokenizer, messages, where, max_chars)
                if args.json:
                    print(json.dumps({"ids": conversation.ids, "loss_mask": conversation.mask}))
                elif shown < args.show:
                    print(_marked(tokenizer, conversation))
                    shown += 1
        sys.stdout.flush()
    except BrokenPipeError:
        _reader_gone()
        return 0
    if defaulted:  # said last, so that a refusal is the one line printed
        print("note: the run's vocabulary has no chat template: rendered as ChatML, its end "
              "token closing each turn, as training would", file=sys.stderr)
    return 0


def _marked(tokenizer, conversation: chats.Conversation) -> str:
    """A conversation's text with its trained tokens marked: green on a terminal, else in
    [[double brackets]]."""
    on, off = ("\033[32m", "\033[0m") if sys.stdout.isatty() else ("[[", "]]")
    pieces, run, trained = [], [], None
    for token, mask in [*zip(conversation.ids, conversation.mask), (None, None)]:
        if mask != trained and run:
            text = tokenizer.decode(run)
            pieces.append(f"{on}{text}{off}" if trained else text)
            run = []
        run.append(token)
        trained = mask
    count = sum(conversation.mask)
    return (f"--- {conversation.where}: {len(conversation.ids)} tokens, {count} trained\n"
            + "".join(pieces))
