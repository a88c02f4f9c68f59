"""`python -m minigpt.hub`: Hugging Face checkpoints in (`import`) and out (`export`)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import minigpt.hub.peft as peft
from minigpt.errors import exit_code
from minigpt.hub.convert import export_run, import_checkpoint
from minigpt.runtime import log, plain_warnings, set_simulated_devices


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minigpt.hub",
                                     description="Hugging Face checkpoints in and out.")
    verbs = parser.add_subparsers(dest="verb", required=True)
    imp = verbs.add_parser("import", help="a Hugging Face checkpoint -> a minigpt run; with "
                                          "--base, a PEFT LoRA adapter onto an imported run")
    imp.add_argument("source", help="a local Hugging Face model directory or a Hub id "
                                    "(openai-community/gpt2, HuggingFaceTB/SmolLM2-135M); with "
                                    "--base, a PEFT adapter folder (adapter_config.json, "
                                    "adapter_model.safetensors)")
    imp.add_argument("--base", help="the run (imported from the adapter's base model) that the "
                                    "PEFT adapter SOURCE adapts: the new run holds its weights "
                                    "and the adapter, and python -m minigpt.train --init-from "
                                    "NEW --set train.lora_rank=R ... continues training it")
    imp.add_argument("--out", required=True, help="the new run directory")
    imp.add_argument("--preset", default="dp", help="how to lay the weights out while loading")
    imp.add_argument("--devices", type=int, default=0, help="simulate this many CPU devices")
    imp.add_argument("--revision", help="a Hub branch, tag or commit to pin")
    exp = verbs.add_parser("export", help="a minigpt run -> a Hugging Face model directory")
    exp.add_argument("--run", required=True, help="the run directory to export")
    exp.add_argument("--out", required=True, help="the directory to write")
    exp.add_argument("--adapter", action="store_true",
                     help="write the run's LoRA adapters as a PEFT adapter folder "
                          "(peft.PeftModel.from_pretrained(base, DIR) loads it onto the model "
                          "the run was imported from) instead of a full checkpoint with them "
                          "merged into the weights")
    exp.add_argument("--max-file-size", type=float, default=2.0,
                     help="GiB per safetensors file before it is split (default 2)")
    args = parser.parse_args(argv)
    if getattr(args, "devices", 0):
        set_simulated_devices(args.devices)
    with plain_warnings():
        return exit_code(lambda: _run(args))


def _run(args: argparse.Namespace) -> int:
    if args.verb == "import" and args.base:
        summary = peft.import_adapter(args.source, args.base, args.out, preset_name=args.preset)
        a = summary["adapters"]
        log(f"imported the rank-{a.rank} adapter {args.source} onto {args.base} into "
            f"{summary['out']}; train it further with: python -m minigpt.train --init-from "
            f"{summary['out']} --set train.lora_rank={a.rank} --set train.lora_alpha={a.alpha:g} "
            f"--set train.lora_targets={','.join(a.targets)} --out NEW")
    elif args.verb == "import":
        summary = import_checkpoint(args.source, args.out, preset_name=args.preset,
                                    revision=args.revision)
        cfg = summary["config"]
        log(f"imported {args.source} ({cfg.arch}, {summary['params']:,} parameters, "
            f"tokenizer {cfg.tokenizer}) into {summary['out']}; tell a story with: "
            f"python -m minigpt.generate --run {summary['out']}")
    elif args.adapter:
        summary = peft.export_adapter(args.run, Path(args.out))
        log(f"exported the adapters of {args.run} (step {summary['step']}, {summary['tensors']} "
            f"tensors, {summary['bytes'] / 2**20:,.2f} MiB) to {summary['out']} as a PEFT "
            f"adapter of {summary['base']}")
    else:
        summary = export_run(args.run, args.out, max_file_bytes=int(args.max_file_size * 2**30))
        log(f"exported {args.run} (step {summary['step']}, "
            f"{summary['bytes'] / 2**20:,.1f} MiB of float32 weights) to {summary['out']}")
    return 0
