"""Importing a Hugging Face checkpoint: time and peak host memory against the checkpoint's size.

    python bench/bench_import.py [--presets dp fsdp] [--devices 8]

Writes a random GPT-2 checkpoint of the 124M shape (float32 safetensors, about 500 MB) in the
Hugging Face layout, then imports it with `python -m minigpt.hub import` under each preset in a
fresh process on simulated CPU devices, and reports the wall time and the process's peak RSS.
On simulated devices, device memory *is* host memory: under `dp` every one of the 8 devices
holds a full copy of the weights, under `fsdp` one eighth. The column "RSS beyond devices" takes
away what the devices hold and the process's resident size before the import started (JAX,
the libraries): what the import itself needed on the host, to compare with the checkpoint's
largest tensor (the token embedding, 154 MB as float32).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def write_checkpoint(directory: Path) -> int:
    """A random GPT-2 124M in the Hub's layout; returns its size in bytes."""
    import numpy as np

    from minigpt.hub import safetensors as weights

    D, L, V, P = 768, 12, 50257, 1024
    rng = np.random.default_rng(0)

    def t(*shape):
        return rng.standard_normal(shape, dtype=np.float32) * 0.02

    tensors = {"wte.weight": t(V, D), "wpe.weight": t(P, D), "ln_f.weight": t(D),
               "ln_f.bias": t(D)}
    for i in range(L):
        tensors |= {f"h.{i}.ln_1.weight": t(D), f"h.{i}.ln_1.bias": t(D),
                    f"h.{i}.attn.c_attn.weight": t(D, 3 * D), f"h.{i}.attn.c_attn.bias": t(3 * D),
                    f"h.{i}.attn.c_proj.weight": t(D, D), f"h.{i}.attn.c_proj.bias": t(D),
                    f"h.{i}.ln_2.weight": t(D), f"h.{i}.ln_2.bias": t(D),
                    f"h.{i}.mlp.c_fc.weight": t(D, 4 * D), f"h.{i}.mlp.c_fc.bias": t(4 * D),
                    f"h.{i}.mlp.c_proj.weight": t(4 * D, D), f"h.{i}.mlp.c_proj.bias": t(D)}
    weights.save(tensors, directory)
    (directory / "config.json").write_text(json.dumps({
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": V,
        "n_positions": P, "n_embd": D, "n_layer": L, "n_head": 12}))
    return sum(a.nbytes for a in tensors.values())


def worker(spec: dict) -> dict:
    """Import in this process and measure: the resident size before, the peak, the time."""
    from minigpt.runtime import set_simulated_devices

    set_simulated_devices(spec["devices"])
    import jax

    from minigpt import hub

    jax.devices()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    start = time.perf_counter()
    summary = hub.import_checkpoint(spec["source"], spec["out"], preset_name=spec["preset"])
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"seconds": seconds, "before": before, "peak": peak, "params": summary["params"],
            "device_bytes": summary["device_bytes"]}


def main() -> None:
    from bench.report import append_section, table

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--presets", nargs="+", default=["dp", "fsdp"])
    parser.add_argument("--devices", type=int, default=8)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    with tempfile.TemporaryDirectory(prefix="minigpt-bench-import-") as tmp:
        source = Path(tmp) / "gpt2-random"
        size = write_checkpoint(source)
        rows = []
        for preset in args.presets:
            spec = {"source": str(source), "out": str(Path(tmp) / f"run-{preset}"),
                    "preset": preset, "devices": args.devices}
            out = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)],
                                 capture_output=True, text=True, check=False, cwd=REPO)
            if out.returncode:
                sys.exit(f"import under {preset} failed:\n{out.stderr[-3000:]}")
            r = json.loads(out.stdout.strip().splitlines()[-1])
            beyond = r["peak"] - r["before"] - r["device_bytes"]
            rows.append((preset, f"{r['seconds']:.1f}", f"{r['peak'] / 2**20:,.0f}",
                         f"{r['before'] / 2**20:,.0f}", f"{r['device_bytes'] / 2**20:,.0f}",
                         f"{beyond / 2**20:,.0f}"))
            print(f"  {preset}: {r['seconds']:.1f} s, peak RSS {r['peak'] / 2**20:,.0f} MiB",
                  flush=True)
    body = table(["preset", "import (s)", "peak RSS (MiB)", "RSS before (MiB)",
                  "held by the devices (MiB)", "RSS beyond devices (MiB)"], rows)
    append_section(f"importing a Hugging Face checkpoint, GPT-2 124M shape, {args.devices} "
                   f"simulated devices", [
        f"a random GPT-2 checkpoint of the 124M shape: {size / 2**20:,.0f} MiB of float32 "
        f"safetensors; its largest tensor (wte) {50257 * 768 * 4 / 2**20:,.0f} MiB",
        "`python -m minigpt.hub import` in a fresh process per preset: read, lay out, write the "
        "run directory (config.json, a step-0 checkpoint); time includes the checkpoint write",
        "on simulated CPU devices device memory is host memory: 'held by the devices' is the "
        "bytes of every device's shards (dp: 8 full copies, fsdp: one copy in eighths)",
    ], body)


if __name__ == "__main__":
    main()
