"""Importing a Hugging Face checkpoint: time and peak host memory against the checkpoint's size.

    python bench/bench_import.py [--shape gpt2-124m|llama-3.2-1b] [--presets dp fsdp]
                                 [--devices 8]

Writes a random checkpoint in the Hugging Face layout — GPT-2's 124M shape (float32
safetensors, about 500 MB), or Llama 3.2 1B's (bfloat16, about 2.5 GB, its rope scaling and tied
embedding, a small tokenizer.json: the tokenizer is not what is measured) — then imports it with
`python -m minigpt.hub import` under each preset in a fresh process on simulated CPU devices, and
reports the wall time and the process's peak RSS.
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

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def write_llama(directory: Path, *, hidden: int, layers: int, heads: int, kv_heads: int,
                intermediate: int, vocab: int, config: dict) -> int:
    """A random tied Llama-family checkpoint in the Hub's layout, bfloat16, with a small
    tokenizer.json (the tokenizer is not what is measured); `config` adds to config.json's shape
    fields. Returns its size in bytes. bench_lora.py writes its shapes with it too."""
    import ml_dtypes
    import numpy as np

    from minigpt.hub import safetensors as weights
    from minigpt.hub.tokenizer_export import tokenizer_json_from_encoding
    from minigpt.tokenizer import load_tokenizer

    D, L, N, K, F, V = hidden, layers, heads, kv_heads, intermediate, vocab
    H = D // N
    rng = np.random.default_rng(0)

    def t(*shape, base=0.0):
        return (base + rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(
            ml_dtypes.bfloat16)

    tensors = {"model.embed_tokens.weight": t(V, D), "model.norm.weight": t(D, base=1.0)}
    for i in range(L):
        p = f"model.layers.{i}"
        tensors |= {f"{p}.input_layernorm.weight": t(D, base=1.0),
                    f"{p}.post_attention_layernorm.weight": t(D, base=1.0),
                    f"{p}.self_attn.q_proj.weight": t(N * H, D),
                    f"{p}.self_attn.k_proj.weight": t(K * H, D),
                    f"{p}.self_attn.v_proj.weight": t(K * H, D),
                    f"{p}.self_attn.o_proj.weight": t(D, N * H),
                    f"{p}.mlp.gate_proj.weight": t(F, D), f"{p}.mlp.up_proj.weight": t(F, D),
                    f"{p}.mlp.down_proj.weight": t(D, F)}
    weights.save(tensors, directory, max_file_bytes=2**33)
    (directory / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": V,
        "hidden_size": D, "intermediate_size": F, "num_hidden_layers": L,
        "num_attention_heads": N, "num_key_value_heads": K, "head_dim": H, "rms_norm_eps": 1e-5,
        "hidden_act": "silu", "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        **config}))
    (directory / "tokenizer.json").write_text(json.dumps(
        tokenizer_json_from_encoding(load_tokenizer("tinystories-4k"))))
    return sum(a.nbytes for a in tensors.values())


def write_llama_1b(directory: Path) -> tuple[int, int]:
    """A random Llama 3.2 1B in the Hub's layout, bfloat16, its rope scaling included; returns
    its size in bytes and that of its largest tensor."""
    size = write_llama(directory, hidden=2048, layers=16, heads=32, kv_heads=8,
                       intermediate=8192, vocab=128256, config={
                           "max_position_embeddings": 131072, "rope_theta": 500000.0,
                           "rope_scaling": {"rope_type": "llama3", "factor": 32.0,
                                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 8192},
                           "bos_token_id": 128000, "eos_token_id": 128001})
    return size, 128256 * 2048 * 2


def write_gpt2_124m(directory: Path) -> tuple[int, int]:
    """A random GPT-2 124M in the Hub's layout; returns its size in bytes and that of its
    largest tensor."""
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
    return sum(a.nbytes for a in tensors.values()), V * D * 4


SHAPES = {"gpt2-124m": (write_gpt2_124m, "GPT-2 124M", "float32"),
          "llama-3.2-1b": (write_llama_1b, "Llama 3.2 1B", "bfloat16")}


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


def _device_need(preset: str, devices: int, source: Path) -> float:
    """MiB of float32 parameters the devices would hold under `dp` (a copy each) or another
    preset (one copy, split), from the checkpoint's parameter count."""
    from minigpt.hub.safetensors import Checkpoint

    checkpoint = Checkpoint(source)
    params = sum(int(np.prod(checkpoint.shape(k))) for k in checkpoint.keys())
    return params * 4 * (devices if preset == "dp" else 1) / 2**20


def main() -> None:
    from bench.report import append_section, table

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="gpt2-124m")
    parser.add_argument("--presets", nargs="+", default=["dp", "fsdp"])
    parser.add_argument("--devices", type=int, default=8)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    with tempfile.TemporaryDirectory(prefix="minigpt-bench-import-") as tmp:
        writer, name, dtype = SHAPES[args.shape]
        source = Path(tmp) / args.shape
        source.mkdir()
        size, largest = writer(source)
        rows = []
        for preset in args.presets:
            spec = {"source": str(source), "out": str(Path(tmp) / f"run-{preset}"),
                    "preset": preset, "devices": args.devices}
            out = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)],
                                 capture_output=True, text=True, check=False, cwd=REPO)
            if out.returncode:  # e.g. killed for memory: say so, and measure the rest
                why = (f"killed by signal {-out.returncode} (out of memory: the devices would "
                       f"hold {_device_need(preset, args.devices, source):,.0f} MiB)"
                       if out.returncode < 0 else f"failed: {out.stderr.strip()[-300:]}")
                rows.append((preset, why, "", "", "", ""))
                print(f"  {preset}: {why}", flush=True)
                continue
            r = json.loads(out.stdout.strip().splitlines()[-1])
            beyond = r["peak"] - r["before"] - r["device_bytes"]
            rows.append((preset, f"{r['seconds']:.1f}", f"{r['peak'] / 2**20:,.0f}",
                         f"{r['before'] / 2**20:,.0f}", f"{r['device_bytes'] / 2**20:,.0f}",
                         f"{beyond / 2**20:,.0f}"))
            print(f"  {preset}: {r['seconds']:.1f} s, peak RSS {r['peak'] / 2**20:,.0f} MiB",
                  flush=True)
    body = table(["preset", "import (s)", "peak RSS (MiB)", "RSS before (MiB)",
                  "held by the devices (MiB)", "RSS beyond devices (MiB)"], rows)
    append_section(f"importing a Hugging Face checkpoint, {name} shape, {args.devices} "
                   f"simulated devices", [
        f"a random {name} checkpoint: {size / 2**20:,.0f} MiB of {dtype} safetensors; its "
        f"largest tensor (the token embedding) {largest / 2**20:,.0f} MiB as stored; parameters "
        f"are float32 in minigpt",
        "`python -m minigpt.hub import` in a fresh process per preset: read, lay out, write the "
        "run directory (config.json, a step-0 checkpoint); time includes the checkpoint write",
        "on simulated CPU devices device memory is host memory: 'held by the devices' is the "
        "bytes of every device's shards (dp: 8 full copies, fsdp: one copy in eighths)",
    ], body)


if __name__ == "__main__":
    main()
