"""Harness requests per second: minigpt's `minigpt` model against lm-evaluation-harness's `hf`.

The same checkpoint, written by transformers with random weights (speed does not depend on
them) and imported with `minigpt.hub`, answers the same log-likelihood requests through both
models' `loglikelihood`, float32 on the CPU, at the same batch size. The requests are shaped
like HellaSwag's (a context of 20 to 60 words of a story, a continuation of the next 5 to 15),
cut from TinyStories text. Each model answers them twice: the first pass includes minigpt's
compiling (a program per padded length), the second is the steady rate. Both passes' answers
are checked against the hf model's (1e-4), so the speed is of the same scores.

    python bench/bench_eval.py [--model gpt2-small|gpt2-tiny] [--requests 256] [--batch-size 16]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SHAPES = {  # transformers GPT2Config fields
    "gpt2-small": dict(n_embd=768, n_layer=12, n_head=12, n_positions=1024),
    "gpt2-tiny": dict(n_embd=64, n_layer=2, n_head=8, n_positions=128),
}


def checkpoint(shape: str, folder: Path) -> Path:
    """A GPT-2 of `shape` with tiktoken's GPT-2 vocabulary, as transformers saves it."""
    import json

    import torch
    import transformers

    from minigpt.hub import tokenizer_export
    from minigpt.tokenizer import load_tokenizer

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=50257,
                                                                 **SHAPES[shape]))
    model.save_pretrained(folder)
    (folder / "tokenizer.json").write_text(json.dumps(
        tokenizer_export.tokenizer_json_from_encoding(load_tokenizer("gpt2"))))
    return folder


def requests(count: int, seed: int = 0):
    """HellaSwag-shaped (context, continuation) requests from TinyStories text."""
    from lm_eval.api.instance import Instance

    assets = Path(os.environ.get("MINIGPT_ASSETS", Path(__file__).resolve().parents[2]
                                 / "shared" / "assets"))
    text = (assets / "tinystories" / "TinyStories-subset-3k.txt").read_text()
    stories = [s.split() for s in text.split("<|endoftext|>") if len(s.split()) > 80]
    rng = random.Random(seed)
    out = []
    for i in range(count):
        words = stories[i % len(stories)]
        k, m = rng.randint(20, 60), rng.randint(5, 15)
        out.append(Instance(request_type="loglikelihood", doc={}, idx=0,
                            arguments=(" ".join(words[:k]), " " + " ".join(words[k:k + m]))))
    return out


def passes(lm, reqs) -> tuple[list[tuple[float, float]], list]:
    """Two passes over the requests: each one's (wall, CPU) seconds, and the answers. The CPU
    seconds (this process's, all threads) say more than the wall's where the machine is
    shared."""
    times, answers = [], None
    for _ in range(2):
        start, cpu = time.perf_counter(), time.process_time()
        answers = lm.loglikelihood(reqs, disable_tqdm=True)
        times.append((time.perf_counter() - start, time.process_time() - cpu))
    return times, answers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt2-small", choices=sorted(SHAPES))
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--record", action="store_true", help="append to bench/RESULTS.md")
    args = parser.parse_args()

    import lm_eval
    import torch
    from lm_eval.models.huggingface import HFLM

    from bench.report import append_section, table
    from minigpt import hub
    from minigpt.eval import MiniGPTLM

    reqs = requests(args.requests)
    with tempfile.TemporaryDirectory() as work:
        folder = checkpoint(args.model, Path(work) / "hf")
        assert hub.main(["import", str(folder), "--out", str(Path(work) / "run")]) == 0
        hf = HFLM(pretrained=str(folder), dtype="float32", device="cpu",
                  batch_size=args.batch_size)
        hf_times, theirs = passes(hf, reqs)
        ours_lm = MiniGPTLM(run=str(Path(work) / "run"), batch_size=args.batch_size,
                            progress=False)
        our_times, ours = passes(ours_lm, reqs)
    gap = max(abs(a[0] - b[0]) for a, b in zip(ours, theirs))
    flags = sum(a[1] != b[1] for a, b in zip(ours, theirs))
    np.testing.assert_allclose([a[0] for a in ours], [b[0] for b in theirs], rtol=1e-4,
                               atol=1e-4)
    tokens = sum(len(hf.tok_encode(c + x)) for c, x in (r.args for r in reqs))
    n = len(reqs)
    rows = [[name, f"{n / first[0]:.1f}", f"{n / second[0]:.1f}", f"{n / second[1]:.1f}",
             f"{first[0]:.1f} ({first[1]:.1f})", f"{second[0]:.1f} ({second[1]:.1f})"]
            for name, (first, second) in (("hf (lm-eval)", hf_times), ("minigpt", our_times))]
    body = table(["model", "requests/s, first pass", "requests/s, second pass",
                  "requests per CPU second, second pass", "first pass s (CPU s)",
                  "second pass s (CPU s)"], rows)
    details = [f"{args.model}: GPT-2 of {SHAPES[args.model]}, tiktoken's GPT-2 vocabulary, "
               f"random weights (transformers' initialisation, seed 0), float32 on the CPU",
               f"{len(reqs)} log-likelihood requests shaped like HellaSwag's from TinyStories "
               f"text, {tokens:,} tokens in all; batch size {args.batch_size} for both",
               f"lm-eval {lm_eval.__version__ if hasattr(lm_eval, '__version__') else ''}, "
               f"torch {torch.__version__} ({torch.get_num_threads()} threads)",
               f"answers: largest log-likelihood difference {gap:.2e}, {flags} greedy flags "
               f"differ; minigpt's first pass includes compiling"]
    if args.record:
        append_section("harness requests per second, minigpt against the hf model", details,
                       body)
    else:
        print("\n".join(["", *details, "", *body]))


if __name__ == "__main__":
    main()
