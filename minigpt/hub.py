"""Pretrained weights in and out: Hugging Face checkpoints become minigpt runs, and back.

    python -m minigpt.hub import openai-community/gpt2 --out runs/gpt2 --preset fsdp --devices 8
    python -m minigpt.hub import HuggingFaceTB/SmolLM2-135M --out runs/smol
    python -m minigpt.hub export --run runs/smol-tuned --out exported/smol-tuned

`import` reads a directory in the Hugging Face layout (config.json, safetensors weights, the
tokenizer files), or fetches one from the Hub with `huggingface_hub` (`pip install -e ".[hub]"`;
`--revision` pins a commit, HF_HUB_OFFLINE=1 and the cache variables are honoured), and writes an
ordinary run directory: config.json, a checkpoint at step 0 holding the weights (no optimizer
state: `python -m minigpt.train --init-from RUN` starts a new run from them), the tokenizer. The
model config comes from the checkpoint's config.json (`GPT2LMHeadModel` -> `gpt2`,
`LlamaForCausalLM` -> `llama`); a field the architecture does not implement is refused, naming
it, before anything is written.

Each parameter goes from the memory-mapped file straight into the preset's sharding: a device
receives only its shard, read from the file when that device's piece is asked for, so the host
holds about one tensor beyond the memory map whatever the preset; in a multi-process job each
process reads only what its own devices hold. Parameters are float32 in minigpt; float16 and
bfloat16 files are converted as they are read.

`export` writes what `transformers.AutoModelForCausalLM.from_pretrained(DIR)` loads: config.json,
float32 safetensors (several files and an index above `--max-file-size`) without the vocabulary's
padding rows, and the tokenizer (`tokenizer.json` and its config; GPT-2's `vocab.json` and
`merges.txt`). Exporting then importing gives back the same parameters, bit for bit.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from minigpt import hf_tokenizer, sharding
from minigpt.checkpoint import Checkpointer, CheckpointError
from minigpt.config import ConfigError, ModelConfig, save_run_config
from minigpt.files import sha256, write_text_atomic
from minigpt.models import build_model, count_params
from minigpt.runtime import log, set_simulated_devices
from minigpt.tokenizer import TokenizerError, load_tokenizer
from minigpt.weights import Checkpoint, WeightsError

# What a Hub download fetches: the config, the weights, the tokenizer files.
HUB_FILES = ["config.json", "*.safetensors", "model.safetensors.index.json", "tokenizer.json",
             "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
             "vocab.json", "merges.txt", "tokenizer.model"]
RUN_TOKENIZER = "vocabulary.tiktoken"  # a converted tokenizer's name inside a run directory
READABLE = (np.float32, np.float16, "bfloat16")


class HubError(RuntimeError):
    """An import or export cannot be done; the message says why and what to do."""


# --- what each architecture's tensors are called, and how they map to ours -------------------

@dataclasses.dataclass(frozen=True)
class Tensor:
    """One of our parameters and the Hugging Face tensor it comes from.

    `path` is the parameter in `nnx.state(model)`; stacked block parameters ([layers, ...])
    come from one tensor per layer, named with `{i}`. The Hugging Face tensor (`hf_shape`) is
    transposed if `transpose` (PyTorch's Linear stores [out, in]), cut into `part[1]` equal
    pieces along its last axis and piece `part[0]` kept (GPT-2 fuses the query, key and value
    projections), reshaped to our per-layer shape, and its rows padded to our padded
    vocabulary if `padded`.
    """

    path: tuple[str, ...]
    name: str
    hf_shape: tuple[int, ...]
    transpose: bool = False
    part: tuple[int, int] = (0, 1)
    padded: bool = False

    @property
    def stacked(self) -> bool:
        return "{i}" in self.name


def gpt2_tensors(cfg: ModelConfig) -> list[Tensor]:
    D, F, V, P = cfg.embed_dim, cfg.mlp_dim, cfg.vocab_size, cfg.context_len
    block = ("blocks", "layers")
    qkv = [Tensor((*block, "attention", proj, kind), f"h.{{i}}.attn.c_attn.{hf}", shape,
                  part=(n, 3))
           for n, proj in enumerate(("query", "key", "value"))
           for kind, hf, shape in (("kernel", "weight", (D, 3 * D)), ("bias", "bias", (3 * D,)))]
    return [
        Tensor(("tokens", "table"), "wte.weight", (V, D), padded=True),
        Tensor(("positions", "table"), "wpe.weight", (P, D)),
        *[Tensor((*block, norm, kind), f"h.{{i}}.{hf}.{hk}", (D,))
          for norm, hf in (("norm1", "ln_1"), ("norm2", "ln_2"))
          for kind, hk in (("scale", "weight"), ("bias", "bias"))],
        *qkv,
        Tensor((*block, "attention", "out", "kernel"), "h.{i}.attn.c_proj.weight", (D, D)),
        Tensor((*block, "attention", "out", "bias"), "h.{i}.attn.c_proj.bias", (D,)),
        Tensor((*block, "mlp", "up", "kernel"), "h.{i}.mlp.c_fc.weight", (D, F)),
        Tensor((*block, "mlp", "up", "bias"), "h.{i}.mlp.c_fc.bias", (F,)),
        Tensor((*block, "mlp", "down", "kernel"), "h.{i}.mlp.c_proj.weight", (F, D)),
        Tensor((*block, "mlp", "down", "bias"), "h.{i}.mlp.c_proj.bias", (D,)),
        Tensor(("final_norm", "scale"), "ln_f.weight", (D,)),
        Tensor(("final_norm", "bias"), "ln_f.bias", (D,)),
    ]


def llama_tensors(cfg: ModelConfig) -> list[Tensor]:
    D, F, V = cfg.embed_dim, cfg.mlp_dim, cfg.vocab_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    block, layer = ("blocks", "layers"), "model.layers.{i}"
    out = [
        Tensor(("tokens", "table"), "model.embed_tokens.weight", (V, D), padded=True),
        Tensor((*block, "norm1", "scale"), f"{layer}.input_layernorm.weight", (D,)),
        Tensor((*block, "norm2", "scale"), f"{layer}.post_attention_layernorm.weight", (D,)),
        *[Tensor((*block, "attention", ours, "kernel"), f"{layer}.self_attn.{hf}.weight",
                 (rows, D), transpose=True)
          for ours, hf, rows in (("query", "q_proj", q), ("key", "k_proj", kv),
                                 ("value", "v_proj", kv))],
        Tensor((*block, "attention", "out", "kernel"), f"{layer}.self_attn.o_proj.weight",
               (D, q), transpose=True),
        Tensor((*block, "mlp", "gate", "kernel"), f"{layer}.mlp.gate_proj.weight", (F, D),
               transpose=True),
        Tensor((*block, "mlp", "up", "kernel"), f"{layer}.mlp.up_proj.weight", (F, D),
               transpose=True),
        Tensor((*block, "mlp", "down", "kernel"), f"{layer}.mlp.down_proj.weight", (D, F),
               transpose=True),
        Tensor(("final_norm", "scale"), "model.norm.weight", (D,)),
    ]
    if not cfg.tie_embeddings:
        out.append(Tensor(("output", "kernel"), "lm_head.weight", (V, D), padded=True))
    return out


TENSORS: dict[str, Callable[[ModelConfig], list[Tensor]]] = {"gpt2": gpt2_tensors,
                                                            "llama": llama_tensors}
# Buffers some files carry that are not parameters: GPT-2's causal masks, old rotary tables.
IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")


def to_ours(tensor: Tensor, hf: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """A Hugging Face array as our parameter (per layer, vocabulary rows not yet padded): a
    view of `hf` where possible, so slicing it reads only the slice."""
    x = hf.T if tensor.transpose else hf
    which, pieces = tensor.part
    width = x.shape[-1] // pieces
    x = x[..., which * width:(which + 1) * width]
    rows = (tensor.hf_shape[0],) if tensor.padded else shape[:1]
    return x.reshape(rows + tuple(shape[1:]))


def to_hf(tensor: Tensor, ours: np.ndarray) -> np.ndarray:
    """The inverse of `to_ours` for one piece: our per-layer array as (a part of) the Hugging
    Face tensor, padding rows dropped."""
    if tensor.padded:
        ours = ours[:tensor.hf_shape[0]]
    shape = tensor.hf_shape[::-1] if tensor.transpose else tensor.hf_shape
    shape = (*shape[:-1], shape[-1] // tensor.part[1])
    x = ours.reshape(shape)
    return x.T if tensor.transpose else x


# --- reading a Hugging Face directory -------------------------------------------------------

def model_config(hf: dict[str, Any]) -> ModelConfig:
    """Our model config from a Hugging Face config.json, refusing what we do not implement."""
    kind = hf.get("model_type")
    if kind == "gpt2":
        return _gpt2_config(hf)
    if kind == "llama":
        return _llama_config(hf)
    raise HubError(f"config.json has model_type {kind!r}: minigpt imports 'gpt2' "
                   f"(GPT2LMHeadModel) and 'llama' (LlamaForCausalLM)")


def _refuse(hf: dict[str, Any], field: str, allowed: Callable[[Any], bool], why: str) -> None:
    if field in hf and not allowed(hf[field]):
        raise HubError(f"config.json has {field} = {json.dumps(hf[field])}: {why}")


def _gpt2_config(hf: dict[str, Any]) -> ModelConfig:
    _refuse(hf, "activation_function", lambda v: v in ("gelu_new", "gelu_pytorch_tanh"),
            "minigpt's gpt2 uses the tanh approximation of GELU (gelu_new)")
    _refuse(hf, "scale_attn_weights", lambda v: v is True, "minigpt scales attention scores")
    _refuse(hf, "scale_attn_by_inverse_layer_idx", lambda v: not v,
            "minigpt's gpt2 does not scale attention by layer")
    _refuse(hf, "add_cross_attention", lambda v: not v, "minigpt's gpt2 is a decoder only")
    _refuse(hf, "tie_word_embeddings", lambda v: v is True,
            "minigpt's gpt2 ties its output head to the token embedding")
    D = hf.get("n_embd", 768)
    return _built(arch="gpt2", vocab_size=hf.get("vocab_size", 50257),
                  context_len=hf.get("n_positions", hf.get("n_ctx", 1024)), embed_dim=D,
                  num_heads=hf.get("n_head", 12), mlp_dim=hf.get("n_inner") or 4 * D,
                  num_layers=hf.get("n_layer", 12), dropout=0.0,
                  norm_eps=hf.get("layer_norm_epsilon", 1e-5))


def _llama_config(hf: dict[str, Any]) -> ModelConfig:
    _refuse(hf, "hidden_act", lambda v: v == "silu", "minigpt's llama uses SwiGLU with silu")
    _refuse(hf, "rope_scaling", lambda v: v is None,
            "minigpt's llama implements plain rotary embeddings, no rope scaling")
    _refuse(hf, "attention_bias", lambda v: not v, "minigpt's llama has no attention biases")
    _refuse(hf, "mlp_bias", lambda v: not v, "minigpt's llama has no MLP biases")
    _refuse(hf, "sliding_window", lambda v: v is None,
            "minigpt's llama attends to the whole context (no sliding window)")
    # transformers 5 writes the rotary settings as `rope_parameters`; earlier files as
    # `rope_theta` (and `rope_scaling`).
    rope = hf.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise HubError(f"config.json has rope_parameters.rope_type = "
                       f"{json.dumps(rope['rope_type'])}: minigpt's llama implements plain "
                       f"rotary embeddings, no rope scaling")
    theta = rope.get("rope_theta", hf.get("rope_theta", 1e4))
    D, N = hf.get("hidden_size", 4096), hf.get("num_attention_heads", 32)
    head_dim = hf.get("head_dim") or D // N
    return _built(arch="llama", vocab_size=hf.get("vocab_size", 32000),
                  context_len=hf.get("max_position_embeddings", 2048), embed_dim=D,
                  num_heads=N, num_kv_heads=hf.get("num_key_value_heads") or N,
                  mlp_dim=hf.get("intermediate_size", 11008),
                  num_layers=hf.get("num_hidden_layers", 32), dropout=0.0,
                  norm_eps=hf.get("rms_norm_eps", 1e-6), rope_theta=theta,
                  head_size=0 if head_dim * N == D else head_dim,
                  tie_embeddings=bool(hf.get("tie_word_embeddings", False)))


def _built(**fields: Any) -> ModelConfig:
    try:
        return ModelConfig(**fields)
    except ConfigError as error:
        raise HubError(f"config.json describes a model minigpt cannot build: {error}") from None


def fetch(source: str, revision: str | None = None) -> Path:
    """A local Hugging Face directory: `source` itself, or the Hub repository `source` (at
    `revision`) downloaded into, or found in, the Hugging Face cache."""
    path = Path(source)
    if path.is_dir():
        return path
    if path.exists() or source.startswith((".", "/", "~")) or source.count("/") > 1:
        raise HubError(f"{source} is not a directory (a Hugging Face model directory or a Hub "
                       f"id such as openai-community/gpt2)")
    try:
        import huggingface_hub
        from huggingface_hub import errors
    except ImportError:
        raise HubError(f"{source} is not a local directory, and fetching it from the Hugging "
                       f"Face Hub needs its client: pip install -e \".[hub]\"") from None
    try:
        return Path(huggingface_hub.snapshot_download(source, revision=revision,
                                                      allow_patterns=HUB_FILES))
    except errors.LocalEntryNotFoundError as error:
        raise HubError(
            f"{source}{f' at {revision}' if revision else ''} is not in the Hugging Face cache "
            f"and cannot be downloaded (offline: HF_HUB_OFFLINE=1, or no network): fetch it "
            f"once where there is a network, or give a local directory "
            f"({_first_line(error)})") from None
    except (errors.RepositoryNotFoundError, errors.GatedRepoError) as error:
        raise HubError(f"the Hub has no repository {source} that this token may read (private "
                       f"or gated ones need `hf auth login`): {_first_line(error)}") from None
    except errors.RevisionNotFoundError:
        raise HubError(f"{source} has no revision {revision!r}") from None
    except (errors.HfHubHTTPError, OSError) as error:
        raise HubError(f"cannot fetch {source} from the Hub: {_first_line(error)}") from None


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:200]


def read_config(directory: Path) -> dict[str, Any]:
    try:
        return json.loads((directory / "config.json").read_text())
    except FileNotFoundError:
        raise HubError(f"{directory} has no config.json: is it a Hugging Face model "
                       f"directory?") from None
    except ValueError as error:
        raise HubError(f"{directory / 'config.json'} is not valid JSON ({error})") from None


class Source:
    """The weights of a Hugging Face directory, checked against the model config: every tensor
    the architecture needs is there with the shape config.json implies, in a dtype minigpt
    reads, and nothing is left over."""

    def __init__(self, directory: Path, cfg: ModelConfig):
        try:
            self.checkpoint = Checkpoint(directory)
        except WeightsError as error:
            raise HubError(str(error)) from None
        self.tensors = TENSORS[cfg.arch](cfg)
        keys = set(self.checkpoint.keys())
        prefixes = [p for p in ("", "transformer.", "model.")
                    if all(self._name(t, 0, p) in keys for t in self.tensors[:1])]
        if not prefixes:
            raise HubError(f"{directory} does not hold {cfg.arch} weights: no tensor named "
                           f"{self.tensors[0].name!r} (with or without a prefix)")
        self.prefix = prefixes[0]
        used = set()
        for tensor in self.tensors:
            for i in range(cfg.num_layers if tensor.stacked else 1):
                name = self._name(tensor, i)
                if name not in keys:
                    raise HubError(f"{directory} lacks {name}, which a {cfg.arch} model with "
                                   f"this config.json needs")
                shape, dtype = self.checkpoint.shape(name), self.checkpoint.dtype(name)
                if shape != tensor.hf_shape:
                    raise HubError(f"tensor {name} has shape {list(shape)}, but config.json "
                                   f"implies {list(tensor.hf_shape)}")
                if dtype not in [np.dtype(d) for d in READABLE]:
                    raise HubError(f"tensor {name} is {dtype}: minigpt reads float32, "
                                   f"bfloat16 and float16 weights")
                used.add(name)
        tied_head = {"lm_head.weight"} if cfg.arch == "gpt2" or cfg.tie_embeddings else set()
        extra = sorted(k for k in keys - used - tied_head if not k.endswith(IGNORED_SUFFIXES))
        if extra:
            raise HubError(f"{directory} holds tensors a {cfg.arch} model does not use "
                           f"({', '.join(extra[:4])}{', ...' if len(extra) > 4 else ''}): "
                           f"its config.json and weights disagree")

    def _name(self, tensor: Tensor, layer: int, prefix: str | None = None) -> str:
        prefix = self.prefix if prefix is None else prefix
        name = tensor.name.format(i=layer)
        # GPT-2 files name tensors with or without "transformer."; Llama's always carry "model."
        # except the untied head.
        return name if name.startswith(("model.", "lm_head.")) else prefix + name

    def read(self, tensor: Tensor, shape: tuple[int, ...], index: tuple[slice, ...]):
        """Our parameter's piece at `index` (a device's shard), read from the file: float32."""
        if tensor.stacked:
            layers = range(shape[0])[index[0]]
            return np.stack([self._one(tensor, i, shape[1:], index[1:]) for i in layers])
        return self._one(tensor, 0, shape, index)

    def _one(self, tensor: Tensor, layer: int, shape: tuple[int, ...], index) -> np.ndarray:
        view = to_ours(tensor, self.checkpoint[self._name(tensor, layer)], shape)
        if not tensor.padded or shape[0] == view.shape[0]:
            return np.asarray(view[index], dtype=np.float32)
        rows = range(shape[0])[index[0]]  # padding rows beyond the file's are zeros
        out = np.zeros((len(rows), *view[(slice(0, 1), *index[1:])].shape[1:]), np.float32)
        real = [r for r in rows if r < view.shape[0]]
        if real:
            assert rows.step == 1, "a shard of rows is a contiguous range"
            out[:len(real)] = view[(slice(real[0], real[-1] + 1), *index[1:])]
        return out


def _key_names(path) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in path)


def load_sharded(source: Source, cfg: ModelConfig, preset: sharding.Preset, mesh):
    """The model with its weights read from `source` straight into the preset's layout: each
    array is assembled from the pieces its (addressable) devices hold, each read from the
    file as that device's piece is asked for."""
    abstract = nnx.eval_shape(lambda: build_model(cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    sharding.check_divisible(preset, mesh, state)
    shardings = sharding.state_shardings(preset, mesh, state)
    by_path = {t.path: t for t in source.tensors}

    def load(path, var, target):
        tensor = by_path[_key_names(path)]
        shape = tuple(var.shape)
        pieces = {}  # devices holding the same piece (replicas) share one read of it

        def piece(index):
            key = tuple((s.start, s.stop, s.step) for s in index)
            if key not in pieces:
                pieces[key] = source.read(tensor, shape, index)
            return pieces[key]

        array = jax.make_array_from_callback(shape, target.get_value(), piece)
        return var.replace(array)

    state = jax.tree_util.tree_map_with_path(
        load, state, shardings, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return nnx.merge(graphdef, state)


def import_tokenizer(directory: Path, cfg: ModelConfig, out: Path, source: str) -> str:
    """The tokenizer name for the run's model config: tiktoken's `gpt2` for GPT-2's own
    vocabulary, otherwise `tokenizer.json` converted into the run directory (written there)."""
    path = directory / "tokenizer.json"
    if cfg.arch == "gpt2" and cfg.vocab_size == 50257 and not path.is_file():
        return "gpt2"
    if not path.is_file():
        sentencepiece = (directory / "tokenizer.model").is_file()
        raise HubError(f"{directory} has no tokenizer.json" + (
            " (only tokenizer.model: a SentencePiece tokenizer, which minigpt does not load; "
            "its runtime tokenizer is tiktoken, which needs byte-level BPE)" if sentencepiece
            else ""))
    try:
        vocab = hf_tokenizer.ranks_from_tokenizer_json(path)
    except TokenizerError as error:
        raise HubError(str(error)) from None
    if cfg.arch == "gpt2" and _is_gpt2_vocabulary(vocab):
        return "gpt2"
    n_vocab = max([*vocab.ranks.values(), *vocab.special_tokens.values()]) + 1
    if n_vocab > cfg.vocab_size:
        raise HubError(f"{path} has {n_vocab:,} tokens but the model's vocabulary is "
                       f"{cfg.vocab_size:,}: the checkpoint and its tokenizer disagree")
    hf_tokenizer.save_as_tiktoken(vocab, out / RUN_TOKENIZER,
                                  {"source": source, "file": "tokenizer.json",
                                   "sha256": sha256(path)})
    return RUN_TOKENIZER


def _is_gpt2_vocabulary(vocab) -> bool:
    try:
        gpt2 = load_tokenizer("gpt2")
    except TokenizerError:
        return False
    return vocab.ranks == gpt2._mergeable_ranks and vocab.special_tokens == gpt2._special_tokens


def import_checkpoint(source: str, out: str | Path, *, preset_name: str = "dp",
                      revision: str | None = None) -> dict[str, Any]:
    """Import a Hugging Face checkpoint into a new run directory `out`; returns a summary.

    Everything is checked (config, tensors, tokenizer) before `out` is touched; the run is
    assembled in a temporary directory beside `out` and renamed into place when complete.
    """
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise HubError(f"{out} already exists and is not empty: choose a new --out")
    directory = fetch(source, revision)
    hf = read_config(directory)
    cfg = model_config(hf)
    weights = Source(directory, cfg)
    preset = sharding.load_preset(preset_name)
    mesh = sharding.make_mesh(preset)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.importing-", dir=out.parent))
    try:
        tokenizer = import_tokenizer(directory, cfg, staging, source)
        cfg = dataclasses.replace(cfg, tokenizer=tokenizer)
        model = load_sharded(weights, cfg, preset, mesh)
        record = {"source": source, "revision": revision, "directory": str(directory),
                  "architecture": (hf.get("architectures") or [None])[0],
                  "weights_dtype": str(weights.checkpoint.dtype(weights._name(
                      weights.tensors[0], 0)))}
        save_run_config(staging / "config.json", cfg, None, imported=record)
        checkpointer = Checkpointer(staging / "checkpoints", async_save=False)
        checkpointer.save(0, model, None, data_state={}, rng=jax.random.key(0))
        checkpointer.wait()
        checkpointer.close()
        if out.exists():
            out.rmdir()  # empty, checked above
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    arrays = jax.tree.leaves(nnx.state(model, nnx.Param))
    return {"out": out, "config": cfg, "params": count_params(model, cfg),
            "device_bytes": sum(s.data.nbytes for a in arrays for s in a.addressable_shards)}


# --- writing a Hugging Face directory -------------------------------------------------------

def hf_config(cfg: ModelConfig, eos: int | None, bos: int | None) -> dict[str, Any]:
    """The config.json transformers needs for our model."""
    common = {"vocab_size": cfg.vocab_size, "torch_dtype": "float32",
              "bos_token_id": bos, "eos_token_id": eos}
    if cfg.arch == "gpt2":
        if cfg.head_dim * cfg.num_heads != cfg.embed_dim:
            raise HubError("GPT-2's heads must split its width exactly: this model sets "
                           "head_size, which GPT2LMHeadModel cannot express")
        return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
                "n_positions": cfg.context_len, "n_embd": cfg.embed_dim,
                "n_layer": cfg.num_layers, "n_head": cfg.num_heads, "n_inner": cfg.mlp_dim,
                "activation_function": "gelu_new", "layer_norm_epsilon": cfg.norm_eps,
                "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
                "tie_word_embeddings": True, **common}
    if cfg.arch == "llama":
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                "hidden_size": cfg.embed_dim, "intermediate_size": cfg.mlp_dim,
                "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
                "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
                "max_position_embeddings": cfg.context_len, "rms_norm_eps": cfg.norm_eps,
                # both spellings: transformers 5 reads the first, earlier versions the second
                "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
                "rope_theta": cfg.rope_theta, "hidden_act": "silu",
                "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
                "tie_word_embeddings": cfg.tie_embeddings, **common}
    raise HubError(f"a {cfg.arch!r} model cannot be exported: no Hugging Face class computes "
                   f"it (minigpt's own architecture normalises after each sublayer); gpt2 and "
                   f"llama models can")


def hf_tensors(model, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Our parameters as Hugging Face tensors (float32, vocabulary padding dropped)."""
    state = {_key_names(path): np.asarray(jax.device_get(var.get_value()))
             for path, var in jax.tree_util.tree_leaves_with_path(
                 nnx.state(model, nnx.Param), is_leaf=lambda x: isinstance(x, nnx.Variable))}
    parts: dict[str, list] = {}
    tensors = TENSORS[cfg.arch](cfg)
    for tensor in tensors:
        array = state[tensor.path]
        for i in range(cfg.num_layers if tensor.stacked else 1):
            piece = to_hf(tensor, array[i] if tensor.stacked else array)
            parts.setdefault(tensor.name.format(i=i), []).append((tensor.part[0], piece))
    prefix = "transformer." if cfg.arch == "gpt2" else ""
    out = {}
    for name, pieces in parts.items():
        pieces = [p for _, p in sorted(pieces, key=lambda item: item[0])]
        joined = pieces[0] if len(pieces) == 1 else np.concatenate(pieces, axis=-1)
        out[prefix + name] = np.ascontiguousarray(joined, dtype=np.float32)
    return out


def export_run(run: str | Path, out: str | Path, *, max_file_bytes: int = 2 * 2**30) -> dict:
    """Write a run's latest weights as a Hugging Face model directory; returns a summary."""
    from minigpt.generate import GenerationError, load_for_generation
    from minigpt.weights import save

    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise HubError(f"{out} already exists and is not empty: choose a new --out")
    try:
        from minigpt.config import load_run_config
        cfg = load_run_config(Path(run) / "config.json")["model"]
    except ConfigError as error:
        raise HubError(str(error)) from None
    enc = load_tokenizer(cfg.tokenizer)
    specials = enc._special_tokens
    eos = specials.get("<|endoftext|>", specials.get("<|im_end|>", enc.eot_token))
    config = hf_config(cfg, eos=eos, bos=eos if cfg.arch == "gpt2" else None)
    try:
        model, _, _, _, step = load_for_generation(run, "dp")
    except (GenerationError, CheckpointError) as error:
        raise HubError(str(error)) from None
    tensors = hf_tensors(model, cfg)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.exporting-", dir=out.parent
                                    if out.parent.exists() else None))
    try:
        files = save(tensors, staging, max_file_bytes=max_file_bytes)
        write_text_atomic(staging / "config.json", json.dumps(config, indent=2) + "\n")
        write_text_atomic(staging / "generation_config.json", json.dumps(
            {"bos_token_id": config["bos_token_id"], "eos_token_id": eos}, indent=2) + "\n")
        token_name = next((t for t, i in specials.items() if i == eos), None)
        hf_tokenizer.write_hf_tokenizer(enc, staging, model_max_length=cfg.context_len,
                                        eos_token=token_name,
                                        bos_token=token_name if cfg.arch == "gpt2" else None)
        out.parent.mkdir(parents=True, exist_ok=True)
        if out.exists():
            out.rmdir()
        shutil.move(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return {"out": out, "step": step, "files": [out / f.name for f in files],
            "bytes": sum(t.nbytes for t in tensors.values())}


# --- the command line -----------------------------------------------------------------------

def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minigpt.hub",
                                     description="Hugging Face checkpoints in and out.")
    verbs = parser.add_subparsers(dest="verb", required=True)
    imp = verbs.add_parser("import", help="a Hugging Face checkpoint -> a minigpt run")
    imp.add_argument("source", help="a local Hugging Face model directory or a Hub id "
                                    "(openai-community/gpt2, HuggingFaceTB/SmolLM2-135M)")
    imp.add_argument("--out", required=True, help="the new run directory")
    imp.add_argument("--preset", default="dp", help="how to lay the weights out while loading")
    imp.add_argument("--devices", type=int, default=0, help="simulate this many CPU devices")
    imp.add_argument("--revision", help="a Hub branch, tag or commit to pin")
    exp = verbs.add_parser("export", help="a minigpt run -> a Hugging Face model directory")
    exp.add_argument("--run", required=True, help="the run directory to export")
    exp.add_argument("--out", required=True, help="the directory to write")
    exp.add_argument("--max-file-size", type=float, default=2.0,
                     help="GiB per safetensors file before it is split (default 2)")
    args = parser.parse_args(argv)
    if getattr(args, "devices", 0):
        set_simulated_devices(args.devices)
    try:
        if args.verb == "import":
            summary = import_checkpoint(args.source, args.out, preset_name=args.preset,
                                        revision=args.revision)
            cfg = summary["config"]
            log(f"imported {args.source} ({cfg.arch}, {summary['params']:,} parameters, "
                f"tokenizer {cfg.tokenizer}) into {summary['out']}; tell a story with: "
                f"python -m minigpt.generate --run {summary['out']}")
        else:
            summary = export_run(args.run, args.out,
                                 max_file_bytes=int(args.max_file_size * 2**30))
            log(f"exported {args.run} (step {summary['step']}, "
                f"{summary['bytes'] / 2**20:,.1f} MiB of float32 weights) to {summary['out']}")
    except (HubError, ConfigError, sharding.PresetError, TokenizerError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
