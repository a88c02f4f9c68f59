"""Serving speed: `python -m minigpt.serve` under 1, 4, 16 and 64 concurrent streaming clients,
beside offline `minigpt.generate` at the same batch and `transformers serve` (continuous
batching on) with the same weights exported through `python -m minigpt.hub export`.

Two models, random weights (speed does not depend on them; with random weights a reply rarely
meets the end token, and the servers are asked to go on past it, `ignore_eos`): a Llama of
SmolLM2-135M's shape (30 layers, width 576, 9 query / 3 KV heads, vocabulary 49,152, tied head;
the TinyStories tokenizer, its 4,096 tokens the first rows of the vocabulary) and the
`stories-cpu` recipe's model (3 layers of `llama-cpu` with query and key norms and a tied head;
its context raised from 128 to 256 so that a prompt and 128 new tokens fit one window, which
changes no weight: positions are rotary). Each client streams one greedy completion of 128 new
tokens from its own prompt; all start at once. Aggregate tokens/s is all clients' tokens over
the wall time of the round; time to first token (TTFT) is from sending the request to its first
chunk; inter-token latency (ITL) is the time between a stream's chunks (minigpt.serve sends a
call's tokens in one chunk: tokens/chunk says how many on average). Offline is
`generate_tokens` on the batch of the same prompts, compiled beforehand, no early stop, run
after each round on minigpt.serve (the fastest of `--repeats` each: the machine's load may
change over minutes, and alternating weighs it on both). Every server gets a warm-up round
first (each load of 4 tokens, then a wait until /health lists nothing compiling); a round
slower than `--limit` is stopped and counted as far as it got; transformers serve runs each
load once.

    python bench/bench_serve.py [--models stories-cpu smol-135m] [--clients 1 4 16 64]
        [--new-tokens 128] [--repeats 2] [--limit 600] [--dtype float32|bfloat16|auto]
        [--no-transformers] [--no-append]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.report import append_section, table  # noqa: E402

NO_CHOICES = re.compile(r'"choices":\s*\[\s*\]')
MAX_LEN = 160  # positions per slot: a prompt of up to 32 tokens and 128 new ones
PROMPTS = [f"Once upon a time, in a town number {i}, there lived a" for i in range(64)]


def model_config(name: str):
    from minigpt.models import get_config, replaced

    if name == "stories-cpu":
        return replaced(get_config("llama-cpu"), num_layers=3, tie_embeddings=True,
                        qk_norm=True, context_len=256)
    if name == "smol-135m":
        return dataclasses.replace(get_config("llama-cpu"), vocab_size=49152, embed_dim=576,
                                   num_heads=9, num_kv_heads=3, mlp_dim=1536, num_layers=30,
                                   tie_embeddings=True, rope_theta=100000.0, context_len=8192)
    raise SystemExit(f"unknown model {name}: stories-cpu or smol-135m")


def make_run(path: Path, cfg) -> Path:
    """A run directory whose checkpoint is the model's random initialisation, except that the
    (tied) embedding rows past the tokenizer's tokens are zero: their logits are then 0 while
    the likeliest real token's is positive, so every greedy token has text (and streams as a
    chunk), as a trained model's would."""
    import jax
    from flax import nnx

    from minigpt.checkpoint import Checkpointer
    from minigpt.models import build_model
    from minigpt.runs import RunDir
    from minigpt.tokenizer import load_tokenizer

    run = RunDir(path)
    run.path.mkdir(parents=True)
    run.write(cfg, None)
    model = build_model(cfg, rngs=nnx.Rngs(0))
    known = load_tokenizer(cfg.tokenizer).n_vocab
    model.tokens.table[...] = model.tokens.table[...].at[known:].set(0.0)
    checkpointer = Checkpointer(run.checkpoints, async_save=False)
    checkpointer.save(0, model, None, data_state={}, rng=jax.random.key(0))
    checkpointer.wait()
    checkpointer.close()
    return run.path


class Offline:
    """minigpt.generate on a batch of the prompts, in this process: tokens/s, compiled
    beforehand (each batch size once)."""

    def __init__(self, run: Path, dtype: str = "float32"):
        from minigpt.runs import load_run

        self.run, self.warm = load_run(run, dtype=dtype), set()

    def __call__(self, batch: int, new_tokens: int) -> float:
        from minigpt.generate import generate_tokens

        prompts = [self.run.tokenizer.encode_prompt(p) for p in PROMPTS[:batch]]
        with self.run.layout.active():
            def go():
                return generate_tokens(self.run.model, prompts, max_new_tokens=new_tokens,
                                       temperature=0.0, stop_ids=())
            if batch not in self.warm:
                go()
                self.warm.add(batch)
            began = time.perf_counter()
            out = go()
            seconds = time.perf_counter() - began
        return sum(map(len, out)) / seconds


async def one_client(client, url: str, model: str, prompt: str, new_tokens: int,
                     record: dict, extra: dict) -> None:
    """Stream one completion, noting in `record` when it began, when each chunk arrived and
    (from the usage chunk) how many tokens it got."""
    body = {"model": model, "prompt": prompt, "max_tokens": new_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, **extra}
    record.update(began=time.perf_counter(), arrivals=[], tokens=None)
    async with client.stream("POST", f"{url}/v1/completions", json=body) as answer:
        if answer.status_code != 200:
            raise RuntimeError(f"{url}: {answer.status_code} {await answer.aread()}")
        async for line in answer.aiter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            # Only the chunk with the counts is parsed: the client shares the CPU with the
            # server it measures, and reading every chunk's JSON would take from the server.
            if not NO_CHOICES.search(line):
                record["arrivals"].append(time.perf_counter())
            if '"usage"' in line and (usage := json.loads(line[5:]).get("usage")):
                record["tokens"] = usage["completion_tokens"]


async def load(url: str, model: str, clients: int, new_tokens: int, limit: float,
               extra: dict) -> dict:
    """All clients at once; after `limit` seconds the round is stopped and its figures are
    what had arrived by then (marked `stopped`)."""
    import httpx

    records = [{} for _ in range(clients)]
    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(timeout=3600, limits=limits) as client:
        began = time.perf_counter()
        tasks = [asyncio.create_task(one_client(client, url, model, PROMPTS[i], new_tokens,
                                                records[i], extra)) for i in range(clients)]
        done, pending = await asyncio.wait(tasks, timeout=limit)
        for task in pending:
            task.cancel()
        for task in done:
            task.result()  # a client's failure is the round's
        wall = time.perf_counter() - began
    ttft = [r["arrivals"][0] - r["began"] for r in records if r.get("arrivals")]
    itl = [b - a for r in records for a, b in zip(r.get("arrivals", []), r.get("arrivals", [])[1:])]
    # A stopped round counts a chunk per token (what transformers serve sends).
    tokens = sum(r.get("tokens") or len(r.get("arrivals", ())) for r in records)
    chunks = sum(len(r.get("arrivals", ())) for r in records)
    return {"tokens/s": tokens / wall, "tokens": tokens, "wall": wall, "stopped": bool(pending),
            "per chunk": tokens / max(chunks, 1),
            "ttft": np.percentile(ttft or [np.nan], [50, 99]) * 1e3,
            "itl": np.percentile(itl or [np.nan], [50, 99]) * 1e3}


def wait_for(process: subprocess.Popen, url: str | None, pattern: str | None, log: Path,
             seconds: float = 900) -> str:
    """The server's URL once it answers /health (read from its log where `pattern` finds it)."""
    import httpx

    began = time.monotonic()
    while time.monotonic() - began < seconds:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited ({process.returncode}): "
                               f"{log.read_text()[-2000:]}")
        if url is None and pattern:
            found = re.search(pattern, log.read_text())
            url = found and found.group(1)
        if url:
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    return url
            except httpx.HTTPError:
                pass
        time.sleep(1)
    raise RuntimeError(f"the server did not start in {seconds} s: {log.read_text()[-2000:]}")


def settle(url: str, seconds: float = 300) -> None:
    """Wait until a server's /health lists nothing compiling (minigpt.serve's; a server
    without the field has nothing to wait for)."""
    import httpx

    began = time.monotonic()
    while time.monotonic() - began < seconds:
        if not httpx.get(f"{url}/health", timeout=5).json().get("compiling"):
            return
        time.sleep(0.5)


def measure_server(command: list[str], log: Path, model: str, clients_list, new_tokens: int,
                   limit: float, *, url: str | None = None, pattern: str | None = None,
                   env=None, extra: dict | None = None, beside=None, repeats: int = 1) -> dict:
    """Start a server, warm it up (the most clients, 4 tokens), run each load `repeats` times (the
    fastest kept), stop it: {clients: figures}. `beside(clients)`, if given, runs after each
    round (offline generation, while the server idles), its best kept as figures["beside"]:
    the two alternate, so that a machine whose load changes over minutes weighs on both."""
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    results = {}
    try:
        url = wait_for(process, url, pattern, log)
        # The warm-up meets what the loads meet (minigpt.serve compiles its prefills by prompt
        # count and its decode programs by rows in use, in the background), and the rounds
        # begin once nothing compiles: they measure serving, not compiling.
        for c in sorted(clients_list, reverse=True):
            asyncio.run(load(url, model, c, 4, limit, extra or {}))
        settle(url)
        for c in clients_list:
            rounds, besides = [], []
            for _ in range(repeats):
                rounds.append(asyncio.run(load(url, model, c, new_tokens, limit, extra or {})))
                if beside is not None:
                    besides.append(beside(c))
            results[c] = max(rounds, key=lambda r: r["tokens/s"])
            results[c]["beside"] = max(besides, default=None)
        return results
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()


def bench_model(name: str, args, folder: Path) -> tuple[list, list[str]]:
    run = make_run(folder / name, model_config(name))
    rows, notes = [], []
    python = sys.executable
    serve, offline = {}, Offline(run, args.dtype)
    # Every load on the default 16 slots; loads of more clients also on as many slots.
    configs = {16: list(args.clients), **{c: [c] for c in args.clients if c > 16}}
    for slots, clients in configs.items():
        serve[slots] = measure_server(
            [python, "-m", "minigpt.serve", "--run", str(run), "--port", "0", "--max-batch",
             str(slots), "--max-len", str(MAX_LEN), "--dtype", args.dtype],
            folder / f"serve-{name}-{slots}.log",
            name, clients, args.new_tokens, args.limit, pattern=r"serving \S+ on (http://\S+) ",
            extra={"ignore_eos": True}, repeats=args.repeats,
            beside=lambda c: offline(c, args.new_tokens))
    theirs = {}
    if args.transformers:
        hf = folder / f"{name}-hf"
        subprocess.run([python, "-m", "minigpt.hub", "export", "--run", str(run), "--out",
                        str(hf)], check=True, capture_output=True)
        # transformers serve refuses `ignore_eos`: without an end token it goes on as well.
        for file in ("config.json", "generation_config.json"):
            config = json.loads((hf / file).read_text())
            config["eos_token_id"] = None
            (hf / file).write_text(json.dumps(config))
        try:
            theirs = measure_server(
                ["transformers", "serve", "--continuous-batching", "--device", "cpu", "--host",
                 "127.0.0.1", "--port", str(args.port), str(hf)],
                folder / f"transformers-{name}.log", str(hf), args.clients, args.new_tokens,
                args.limit, url=f"http://127.0.0.1:{args.port}",
                env={**os.environ, "HF_HUB_OFFLINE": "1"})
        except RuntimeError as error:
            notes.append(f"transformers serve failed for {name}: {error}")
    for slots, c in ((slots, c) for slots, clients in configs.items() for c in clients):
        mine = serve[slots][c]
        alone = mine["beside"]
        other = theirs.get(c)
        stopped = " (stopped)" if other and other["stopped"] else ""
        rows.append([f"{name} ({args.dtype})", c, slots, f"{mine['tokens/s']:,.0f}",
                     f"{alone:,.0f}",
                     f"{mine['tokens/s'] / alone:.2f}x",
                     f"{other['tokens/s']:,.1f}{stopped}" if other else "-",
                     f"{mine['tokens/s'] / other['tokens/s']:.1f}x" if other else "-",
                     *(f"{v:,.0f}" for v in mine["ttft"]), *(f"{v:,.1f}" for v in mine["itl"]),
                     f"{mine['per chunk']:.1f}",
                     *((f"{v:,.0f}" for v in other["ttft"]) if other else ("-", "-")),
                     *((f"{v:,.1f}" for v in other["itl"]) if other else ("-", "-"))])
        print(rows[-1], flush=True)
    return rows, notes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["stories-cpu", "smol-135m"])
    parser.add_argument("--clients", nargs="+", type=int, default=[1, 4, 16, 64])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2,
                        help="rounds of each load on minigpt.serve, each followed by offline "
                             "generation; the fastest of each kept")
    parser.add_argument("--port", type=int, default=8765, help="transformers serve's port")
    parser.add_argument("--limit", type=float, default=600,
                        help="seconds a round may take; a slower round is stopped and counted "
                             "as far as it got")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "auto"),
                        help="what minigpt.serve and offline generation compute in (--dtype); "
                             "transformers serve runs the float32 export")
    parser.add_argument("--no-transformers", dest="transformers", action="store_false")
    parser.add_argument("--no-append", dest="append", action="store_false")
    args = parser.parse_args()
    rows, notes = [], []
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as folder:
        for name in args.models:
            more, said = bench_model(name, args, Path(folder))
            rows += more
            notes += said
    header = ["model", "clients", "slots", "serve tokens/s", "offline tokens/s",
              "serve / offline", "transformers tokens/s", "serve / transformers",
              "serve TTFT p50 ms", "p99", "serve ITL p50 ms", "p99", "serve tokens/chunk",
              "transformers TTFT p50 ms", "p99", "transformers ITL p50 ms", "p99"]
    body = table(header, rows)
    print("\n".join(body + notes))
    if args.append:
        import jax
        import transformers

        append_section("serving, minigpt.serve beside offline generation and transformers "
                       "serve", [
            f"{args.new_tokens} new tokens per client, greedy, all clients at once, streaming "
            f"/v1/completions; minigpt.serve --max-batch 16 (slots) for every load and as many "
            f"slots as clients past 16, --max-len {MAX_LEN}; offline: generate_tokens at the "
            f"clients' batch, after each of {args.repeats} rounds on minigpt.serve (the fastest "
            f"of each kept), both computing in {args.dtype} (--dtype); transformers serve: the "
            f"float32 export, each load once, stopped after {args.limit:g} s",
            f"jax {jax.__version__}, transformers {transformers.__version__} (transformers "
            f"serve --continuous-batching --device cpu); random weights", *notes], body)


if __name__ == "__main__":
    main()
