"""minigpt beside llama2.c at llama2.c's own shape: training tokens per second, one CPU device.

llama2.c (karpathy) trains Llama-style models on TinyStories in PyTorch, which is what a person
with a laptop and ten minutes might pick instead of minigpt. This script runs its own `model.py`
(read from ../shared/peers/, or MINIGPT_PEERS; never copied into this repository) the way its
`train.py` steps: forward with targets, backward, gradient clipping at 1.0, AdamW with decay on
2-D tensors, gradients set to None, eagerly, under `torch.compile`, and compiled with its
forward under `torch.autocast("cpu", torch.bfloat16)` (bfloat16 products, float32 weights: what
its train.py's `--dtype bfloat16` does). Beside it runs minigpt's compiled train step on the
zoo's `llama-cpu` at the same shape with the same optimizer (AdamW at 6e-3, decay 0.1,
clipping). Each
contender lives in a process of its own, as it does for its users, and they take turns
(A B C A B C ...), each turn a fixed number of steps on the same random batch, so a change in the
machine's load touches all of them alike; the table gives the median turn. Every process runs
with malloc's huge pages, as `python -m minigpt.train` does (minigpt.runtime).

    python bench/bench_llama2c.py                    # about 4 minutes on 2 cores
    python bench/bench_llama2c.py --rounds 3 --steps 10 --no-record

Shape (the zoo's `llama-cpu`; the `stories-cpu` recipe now trains it with 2 of its 4 layers, a
tied output layer and a context of 128 at batch 16): width 128, 4 layers, 4 heads, SwiGLU 384,
vocabulary 4,096, context 256, batch 8. llama2.c ties its output layer to the embedding;
`llama-cpu` does not, so minigpt is measured both ways. torch is an optional benchmark
dependency (`pip install torch`); without it, or without the peer file, the script says so and
exits.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.report import append_section, table  # noqa: E402
from minigpt import runtime  # noqa: E402

PEER = "llama2c_model.py"
BATCH, VOCAB = 8, 4096


def peers_dir() -> Path:
    return Path(os.environ.get("MINIGPT_PEERS", REPO.parent / "shared" / "peers"))


def load_peer():
    """llama2.c's model.py as a module, or exit saying what is missing."""
    path = peers_dir() / PEER
    if not path.is_file():
        sys.exit(f"skipped: {path} not found (set MINIGPT_PEERS to the folder holding llama2.c's "
                 f"model.py saved as {PEER})")
    try:
        import torch  # noqa: F401
    except ImportError:
        sys.exit("skipped: torch is not installed (pip install torch); it is only needed here")
    spec = importlib.util.spec_from_file_location("llama2c_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def torch_contender(peer, cfg, tokens, *, compiled: bool, autocast: bool = False):
    """A function running n of llama2.c's training steps on one batch; with `autocast`, its
    forward under `torch.autocast("cpu", torch.bfloat16)`, as its train.py's `ctx` runs it
    where bfloat16 is asked (float32 weights and optimizer, bfloat16 products)."""
    import contextlib

    import torch

    torch.manual_seed(0)
    args = peer.ModelArgs(dim=cfg.embed_dim, n_layers=cfg.num_layers, n_heads=cfg.num_heads,
                          n_kv_heads=cfg.num_kv_heads, vocab_size=cfg.vocab_size,
                          hidden_dim=cfg.mlp_dim, norm_eps=cfg.norm_eps,
                          max_seq_len=cfg.context_len, dropout=0.0)
    model = peer.Transformer(args)
    optimizer = model.configure_optimizers(0.1, 6e-3, (0.9, 0.95), "cpu")
    step_model = torch.compile(model) if compiled else model
    x = torch.from_numpy(tokens[:, :-1]).long().contiguous()
    y = torch.from_numpy(tokens[:, 1:]).long().contiguous()

    ctx = (torch.autocast("cpu", dtype=torch.bfloat16) if autocast
           else contextlib.nullcontext())

    def run(n: int) -> float:
        for _ in range(n):
            with ctx:
                step_model(x, y)
            loss = model.last_loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return float(loss.item())

    return run


def minigpt_contender(cfg, tokens):
    """A function running n of minigpt's compiled train steps (AdamW, as llama2.c steps)."""
    import jax
    from flax import nnx

    from minigpt import sharding
    from minigpt.config import TrainConfig
    from minigpt.models import build_model
    from minigpt.optim import lr_schedule, steps
    from minigpt.optim.optimizer import make_optimizer

    train_cfg = TrainConfig(batch_size=BATCH, lr=6e-3, weight_decay=0.1, steps=100_000)
    model = build_model(cfg, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, make_optimizer(train_cfg), wrt=nnx.Param)
    rates = lr_schedule.lr_schedule(train_cfg)
    rng = jax.random.key(0)
    layout = sharding.Layout.make("dp")
    with layout.active():
        batch = sharding.put_batch({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]},
                                   layout.batch_sharding())

    def run(n: int) -> float:
        with layout.active():
            for _ in range(n):
                metrics = steps.train_step(model, optimizer, batch, rng, rates)
            return float(metrics["loss"])

    return run


# name: (framework, tied output head, torch.compile, bfloat16 products: the peer's autocast,
# minigpt's model.dtype=bfloat16, bfloat16 operands accumulated in float32 on a CPU)
CONTENDERS = {
    "minigpt (llama-cpu: untied head)": ("minigpt", False, False, False),
    "minigpt (tied, as llama2.c)": ("minigpt", True, False, False),
    "minigpt (tied, bfloat16 products)": ("minigpt", True, False, True),
    "llama2.c, PyTorch eager": ("torch", True, False, False),
    "llama2.c, torch.compile": ("torch", True, True, False),
    "llama2.c, torch.compile, bfloat16 autocast": ("torch", True, True, True),
}


def contender_process(name: str, conn) -> None:
    """Build one contender in a process of its own, then run a turn of n steps each time the
    parent sends n (0 ends it), answering with the seconds it took. A process per contender is
    how each one runs for its users; two compiled minigpt models in one process ran 7% slower
    than one alone (4,267 against 4,608 tokens/s, 2026-11-24)."""
    import numpy as np

    from minigpt.models import get_config

    framework, tied, compiled, autocast = CONTENDERS[name]
    cfg = get_config("llama-cpu")
    tokens = np.random.default_rng(0).integers(0, VOCAB, (BATCH, cfg.context_len + 1))
    tokens = tokens.astype(np.int32)
    if framework == "minigpt":
        run = minigpt_contender(dataclasses.replace(
            cfg, tie_embeddings=tied, dtype="bfloat16" if autocast else "float32"), tokens)
    else:
        run = torch_contender(load_peer(), cfg, tokens, compiled=compiled, autocast=autocast)
    start = time.perf_counter()
    loss = run(3)  # compile and warm up, untimed
    conn.send((time.perf_counter() - start, loss, describe(framework)))
    while n := conn.recv():
        start = time.perf_counter()
        run(n)
        conn.send(time.perf_counter() - start)


def describe(framework: str) -> str:
    if framework == "torch":
        import torch
        return f"torch {torch.__version__}, {torch.get_num_threads()} threads"
    import jax

    from minigpt.models import kernels
    return (f"kernels \"{kernels.kernel_set('auto')}\" on {jax.default_backend()}; "
            f"jax {jax.__version__}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7, help="turns per contender")
    parser.add_argument("--steps", type=int, default=20, help="steps per turn")
    parser.add_argument("--no-record", action="store_true", help="print, do not append")
    args = parser.parse_args()
    runtime.relaunch_with_huge_pages()
    load_peer()  # exits saying what is missing before any process starts

    from minigpt.models import get_config

    cfg = get_config("llama-cpu")
    spawn = multiprocessing.get_context("spawn")
    pipes, workers, about = {}, [], {}
    for name in CONTENDERS:  # one at a time, so no compilation runs beside another's
        pipes[name], theirs = spawn.Pipe()
        workers.append(spawn.Process(target=contender_process, args=(name, theirs)))
        workers[-1].start()
        seconds, loss, about[CONTENDERS[name][0]] = pipes[name].recv()
        print(f"warm-up {name}: {seconds:.1f} s, loss {loss:.3f}", flush=True)
    turns: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    names = list(pipes)
    for r in range(args.rounds):
        # Each round starts one contender later, so each takes every place in the order and no
        # turn always follows the same one (whatever a turn leaves behind falls on all alike).
        for name in names[r % len(names):] + names[:r % len(names)]:
            pipes[name].send(args.steps)
            turns[name].append(BATCH * cfg.context_len * args.steps / pipes[name].recv())
        print(f"round {r + 1}: " + ", ".join(f"{n.split(' (')[0].split(',')[-1].strip()} "
                                             f"{t[-1]:,.0f}" for n, t in turns.items()),
              flush=True)
    for pipe, worker in zip(pipes.values(), workers):
        pipe.send(0)
        worker.join()

    # Each round's ratio to the faster of the two compiled peers' turns beside it, as well as
    # the ratio of medians: a machine whose speed drifts moves every turn of a round alike.
    peers = ["llama2.c, torch.compile", "llama2.c, torch.compile, bfloat16 autocast"]
    best = [max(pair) for pair in zip(*(turns[name] for name in peers))]
    rows = [[name, f"{statistics.median(t):,.0f}", f"{min(t):,.0f}-{max(t):,.0f}",
             f"{statistics.median(t) / statistics.median(best):.2f}x",
             f"{statistics.median(a / b for a, b in zip(t, best)):.2f}x"]
            for name, t in turns.items()]
    header = ["contender", "tokens/s (median)", "range", "vs the faster compiled peer",
              "per round (median)"]
    if args.no_record:
        print("\n".join(table(header, rows)))
        return
    append_section(
        "minigpt beside llama2.c at its own shape: training tokens/s, one CPU device",
        [f"shape: width {cfg.embed_dim}, {cfg.num_layers} layers, {cfg.num_heads} heads, "
         f"SwiGLU {cfg.mlp_dim}, vocabulary {VOCAB}, context {cfg.context_len}, batch {BATCH}; "
         "float32, or bfloat16 products (the peer: torch.autocast; minigpt: model.dtype "
         "bfloat16, bfloat16 operands with float32 accumulation and float32 activations); "
         "AdamW (decay 0.1 on matrices), clipping at 1.0",
         f"llama2.c: its model.py (commit 350e04f, from {PEER} in {peers_dir()}) stepped as "
         f"its train.py does; {about['torch']}",
         f"minigpt: `steps.train_step` (compiled once), {about['minigpt']}",
         "each contender in a process of its own, the parent asking each in turn for its steps",
         f"malloc: GLIBC_TUNABLES={os.environ.get('GLIBC_TUNABLES', '(unset)')} for both, as "
         "`minigpt.train` runs",
         f"{args.rounds} alternating turns of {args.steps} steps each after 3 warm-up steps, each "
         "round starting one contender later "
         "(compilation excluded for both); median and range of the turns, and the median of each "
         "round's ratio to the faster of its two compiled peer turns"],
        table(header, rows))

if __name__ == "__main__":
    main()
