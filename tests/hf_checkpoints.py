"""Tiny random checkpoints in the Hugging Face layout, written by the tests (test_hub and the
notebook test): config.json, safetensors weights named as the Hub's files name them, and a
tokenizer.json."""

import json
from pathlib import Path

import numpy as np

from minigpt.hub import safetensors as weights
from minigpt.hub import tokenizer_export
from minigpt.tokenizer import load_tokenizer


def gpt2_checkpoint(D=32, N=8, L=8, V=50257, P=64, seed=0):
    """(config.json, tensors) of a random GPT-2, named as the Hub's files name them."""
    rng = np.random.default_rng(seed)

    def t(*shape, base=0.0):
        return (base + rng.standard_normal(shape) * 0.2).astype(np.float32)

    w = {"wte.weight": t(V, D), "wpe.weight": t(P, D), "ln_f.weight": t(D, base=1.0),
         "ln_f.bias": t(D)}
    for i in range(L):
        w |= {f"h.{i}.ln_1.weight": t(D, base=1.0), f"h.{i}.ln_1.bias": t(D),
              f"h.{i}.attn.c_attn.weight": t(D, 3 * D), f"h.{i}.attn.c_attn.bias": t(3 * D),
              f"h.{i}.attn.c_proj.weight": t(D, D), f"h.{i}.attn.c_proj.bias": t(D),
              f"h.{i}.ln_2.weight": t(D, base=1.0), f"h.{i}.ln_2.bias": t(D),
              f"h.{i}.mlp.c_fc.weight": t(D, 4 * D), f"h.{i}.mlp.c_fc.bias": t(4 * D),
              f"h.{i}.mlp.c_proj.weight": t(4 * D, D), f"h.{i}.mlp.c_proj.bias": t(D),
              # the causal-mask buffer older files carry: not a parameter
              f"h.{i}.attn.bias": np.tril(np.ones((P, P), np.float32))[None, None]}
    config = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": V,
              "n_positions": P, "n_embd": D, "n_layer": L, "n_head": N,
              "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5}
    return config, w


def llama_checkpoint(D=64, N=8, K=2, F=96, L=2, V=4096, tied=False, head_dim=None, seed=0,
                     qk_norm=False):
    """(config.json, tensors) of a random Llama, or with `qk_norm` a Qwen3 (Llama with a
    learned RMSNorm over each query and key head)."""
    rng = np.random.default_rng(seed)
    H = head_dim or D // N

    def t(*shape, base=0.0):
        return (base + rng.standard_normal(shape) * 0.2).astype(np.float32)

    w = {"model.embed_tokens.weight": t(V, D), "model.norm.weight": t(D, base=1.0)}
    if not tied:
        w["lm_head.weight"] = t(V, D)
    for i in range(L):
        p = f"model.layers.{i}"
        w |= {f"{p}.input_layernorm.weight": t(D, base=1.0),
              f"{p}.post_attention_layernorm.weight": t(D, base=1.0),
              f"{p}.self_attn.q_proj.weight": t(N * H, D),
              f"{p}.self_attn.k_proj.weight": t(K * H, D),
              f"{p}.self_attn.v_proj.weight": t(K * H, D),
              f"{p}.self_attn.o_proj.weight": t(D, N * H),
              f"{p}.mlp.gate_proj.weight": t(F, D), f"{p}.mlp.up_proj.weight": t(F, D),
              f"{p}.mlp.down_proj.weight": t(D, F)}
        if qk_norm:
            w |= {f"{p}.self_attn.q_norm.weight": t(H, base=1.0),
                  f"{p}.self_attn.k_norm.weight": t(H, base=1.0)}
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": V,
              "hidden_size": D, "intermediate_size": F, "num_hidden_layers": L,
              "num_attention_heads": N, "num_key_value_heads": K, "hidden_act": "silu",
              "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "rope_theta": 5000.0,
              "rope_scaling": None, "attention_bias": False, "mlp_bias": False,
              "tie_word_embeddings": tied}
    if head_dim or qk_norm:  # a Qwen3 config without it means heads of 128
        config["head_dim"] = H
    if qk_norm:
        config |= {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
                   "use_sliding_window": False, "sliding_window": None,
                   "layer_types": ["full_attention"] * L}
    return config, w


def write_hf(directory: Path, config: dict, tensors: dict, *, dtype=np.float32,
             max_file_bytes=2**31, tokenizer: str | None = None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    weights.save({k: v.astype(dtype) for k, v in tensors.items()}, directory,
                 max_file_bytes=max_file_bytes)
    if tokenizer:
        (directory / "tokenizer.json").write_text(json.dumps(
            tokenizer_export.tokenizer_json_from_encoding(load_tokenizer(tokenizer))))
    return directory
