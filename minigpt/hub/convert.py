"""Hugging Face checkpoints become minigpt runs, and runs become Hugging Face directories.

`import_checkpoint` reads a directory in the Hugging Face layout (config.json, safetensors weights,
the tokenizer files), or fetches one from the Hub with `huggingface_hub` (`pip install -e ".[hub]"`;
`--revision` pins a commit, HF_HUB_OFFLINE=1 and the cache variables are honoured), and writes an
ordinary run directory: config.json, a checkpoint at step 0 holding the weights (no optimizer state:
`python -m minigpt.train --init-from RUN` starts a new run from them), the tokenizer. The model
config comes from the checkpoint's config.json (`GPT2LMHeadModel` -> `gpt2`, `LlamaForCausalLM` ->
`llama`, `Qwen3ForCausalLM` -> `llama` with `qk_norm`); a field the architecture does not implement
is refused, naming it, before anything is written.

Each parameter goes from the memory-mapped file straight into the preset's sharding: a device
receives only its shard, read from the file when that device's piece is asked for, so the host
holds about one tensor beyond the memory map whatever the preset; in a multi-process job each
process reads only what its own devices hold. Parameters are float32 in minigpt; float16 and
bfloat16 files are converted as they are read.

`export_run` writes what `transformers.AutoModelForCausalLM.from_pretrained(DIR)` loads:
config.json, float32 safetensors (several files and an index above `--max-file-size`) without the
vocabulary's padding rows, and the tokenizer (`tokenizer.json` and its config; GPT-2's `vocab.json`
and `merges.txt`). Exporting then importing gives back the same parameters, bit for bit."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

import minigpt.hub.tokenizer_export as tokenizer_export
import minigpt.hub.tokenizer_files as tokenizer_files
from minigpt import runtime, sharding
from minigpt.checkpoint import Checkpointer, key_names
from minigpt.config import ModelConfig
from minigpt.files import first_line, read_json_object, write_text_atomic
from minigpt.hub.architectures import (
    IGNORED_SUFFIXES,
    HubError,
    Tensor,
    hf_name,
    instances,
    mapping,
    to_hf,
    to_ours,
)
from minigpt.hub.configs import head_as_transformers_reads, hf_config, model_config
from minigpt.hub.safetensors import Checkpoint, WeightsError, resolve_inside
from minigpt.hub.safetensors import save as save_weights
from minigpt.models import build_model, count_params
from minigpt.runs import LOAD_ERRORS, RunDir, load_run
from minigpt.tokenizer import HFTokenizer, load_tokenizer

# What a Hub download fetches: the config, the weights, the tokenizer files.
HUB_FILES = ["config.json", "*.safetensors", "model.safetensors.index.json", "tokenizer.json",
             "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
             "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja"]
READABLE = (np.float32, np.float16, "bfloat16")


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
            f"({first_line(error)})") from None
    except (errors.RepositoryNotFoundError, errors.GatedRepoError) as error:
        raise HubError(f"the Hub has no repository {source} that this token may read (private "
                       f"or gated ones need `hf auth login`): {first_line(error)}") from None
    except errors.RevisionNotFoundError:
        raise HubError(f"{source} has no revision {revision!r}") from None
    except (errors.HfHubHTTPError, OSError) as error:
        raise HubError(f"cannot fetch {source} from the Hub: {first_line(error)}") from None


def read_config(directory: Path) -> dict[str, Any]:
    """A Hugging Face config.json, which must be a JSON object (its fields are checked where
    they are read, `configs.model_config`)."""
    return read_json_object(directory / "config.json", HubError, missing=(
        f"{directory} has no config.json: is it a Hugging Face model directory?"))


class Source:
    """The weights of a Hugging Face directory, checked against the model config: every tensor
    the architecture needs is there with the shape config.json implies, in a dtype minigpt
    reads, and nothing is left over."""

    def __init__(self, directory: Path, cfg: ModelConfig):
        try:
            self.checkpoint = Checkpoint(directory)
        except WeightsError as error:
            raise HubError(str(error)) from None
        self.hub = mapping(cfg)
        self.tensors = self.hub.tensors(cfg)
        keys = set(self.checkpoint.keys())
        first = self.tensors[0]  # the token embedding
        self.spelling = next((s for s in self.hub.spellings
                              if self._name(first, (), s) in keys), None)
        if self.spelling is None:
            raise HubError(f"{directory} does not hold {cfg.arch} weights: no tensor named "
                           f"{first.name!r} (in any layout its checkpoints use)")
        self.dtype = self.checkpoint.dtype(self._name(first, ()))  # as the file stores it
        used = set()
        for tensor in self.tensors:
            for ids in instances(tensor, cfg):
                name = self._name(tensor, ids)
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
        head = {self.hub.spelled(n, self.spelling) for n in ("lm_head.weight",)}
        tied_head = head if self.hub.tied(cfg) else set()
        extra = sorted(k for k in keys - used - tied_head if not k.endswith(IGNORED_SUFFIXES)
                       and not k.startswith(self.hub.ignored or ("\0",)))
        if extra:
            raise HubError(f"{directory} holds tensors a {cfg.arch} model does not use "
                           f"({', '.join(extra[:4])}{', ...' if len(extra) > 4 else ''}): "
                           f"its config.json and weights disagree")

    def _name(self, tensor: Tensor, ids: tuple[int, ...] | int,
              spelling: tuple[str, str] | None = None) -> str:
        """The file's name of a table row at `ids` (GPT-2 files name tensors with or without
        "transformer.", a multimodal Gemma's under "language_model.": the family's
        spellings)."""
        return self.hub.spelled(hf_name(tensor, ids), spelling or self.spelling)

    def read(self, tensor: Tensor, shape: tuple[int, ...], index: tuple[slice, ...],
             ids: tuple[int, ...] = ()):
        """Our parameter's piece at `index` (a device's shard), read from the file: float32.
        A parameter stacked over layers (and experts) is one file tensor per layer (and
        expert): only those of the device's own layers and experts are read."""
        if len(ids) < tensor.stack_depth:
            picked = range(shape[0])[index[0]]
            return np.stack([self.read(tensor, shape[1:], index[1:], (*ids, i)) for i in picked])
        return self._one(tensor, ids, shape, index)

    def _one(self, tensor: Tensor, ids: tuple[int, ...], shape: tuple[int, ...],
             index) -> np.ndarray:
        view = to_ours(tensor, self.checkpoint[self._name(tensor, ids)], shape)
        if not tensor.padded or shape[0] == view.shape[0]:
            return np.asarray(view[index], dtype=np.float32)
        rows = range(shape[0])[index[0]]  # padding rows beyond the file's are zeros
        out = np.zeros((len(rows), *view[(slice(0, 1), *index[1:])].shape[1:]), np.float32)
        real = [r for r in rows if r < view.shape[0]]
        if real:
            assert rows.step == 1, "a shard of rows is a contiguous range"
            out[:len(real)] = view[(slice(real[0], real[-1] + 1), *index[1:])]
        return out


def load_sharded(source: Source, cfg: ModelConfig, layout: sharding.Layout):
    """The model with its weights read from `source` straight into the preset's layout: each
    array is assembled from the pieces its (addressable) devices hold, each read from the
    file as that device's piece is asked for."""
    abstract = nnx.eval_shape(lambda: build_model(cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    sharding.check_divisible(layout, state)
    shardings = sharding.state_shardings(layout, state)
    by_path = {t.path: t for t in source.tensors}

    def load(path, var, target):
        tensor = by_path[key_names(path)]
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


def import_tokenizer(directory: Path, hf: dict[str, Any], cfg: ModelConfig,
                     run: Path) -> str:
    """The run's tokenizer: the checkpoint's own tokenizer files, copied into the run and read
    by the `tokenizers` library (`tokenizer_files`); tiktoken's `gpt2` for a GPT-2 checkpoint
    that carries no tokenizer.json."""
    if (directory / "tokenizer.json").is_file() or (directory / "tokenizer.json").is_symlink():
        tokenizer_files.import_tokenizer_files(directory, hf, run, cfg.vocab_size,
                                               lambda path, name: _inside(directory, name))
        return tokenizer_files.FOLDER
    meant = mapping(cfg).tokenizer(cfg)  # GPT-2's own files carry no tokenizer.json
    if meant:
        return meant
    if (directory / "tokenizer.model").is_file():
        raise HubError(f"{directory} has only tokenizer.model, SentencePiece's own format: "
                       f"minigpt reads tokenizer.json, the tokenizers library's (transformers "
                       f"writes one: AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR))")
    raise HubError(f"{directory} has no tokenizer.json")


def _inside(directory: Path, name: str) -> Path:
    try:
        return resolve_inside(directory, name, f"the checkpoint's {name}")
    except WeightsError as error:
        raise HubError(str(error)) from None


@contextlib.contextmanager
def _new_directory(out: Path):
    """A temporary directory beside `out` to assemble it in, moved into place when the block
    ends well and removed otherwise: `out` is written whole or not at all, never over files.
    It gets the permissions any new directory gets (the umask's), not a temporary one's."""
    check_out(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.writing-", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    staging.chmod(0o777 & ~umask)
    try:
        yield staging
        if out.exists():
            out.rmdir()  # empty, checked above
        staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def check_out(out: Path) -> None:
    """Refuse an output path that is a file, or a directory with anything in it."""
    if out.exists() and not out.is_dir():
        raise HubError(f"--out {out} is a file: choose a new directory")
    if out.exists() and any(out.iterdir()):
        raise HubError(f"{out} already exists and is not empty: choose a new --out")


def import_checkpoint(source: str, out: str | Path, *, preset_name: str = "dp",
                      revision: str | None = None) -> dict[str, Any]:
    """Import a Hugging Face checkpoint into a new run directory `out`; returns a summary.

    Everything is checked (config, tensors, tokenizer) before `out` is touched; the run is
    assembled in a temporary directory beside `out` and renamed into place when complete.
    """
    out = Path(out)
    check_out(out)  # before a download, not only before writing
    directory = fetch(source, revision)
    hf = read_config(directory)
    cfg = model_config(hf, directory / "config.json")
    try:
        cfg = head_as_transformers_reads(cfg, Checkpoint(directory))
    except WeightsError as error:
        raise HubError(str(error)) from None
    weights = Source(directory, cfg)
    layout = sharding.Layout.make(preset_name)
    runtime.check_fits(layout, [nnx.state(nnx.eval_shape(
        lambda: build_model(cfg, rngs=nnx.Rngs(0))))], what=f"the model of {directory}",
        hint="import it under a preset that splits the weights (--preset fsdp), or on a "
             "machine with more memory")
    with _new_directory(out) as staging:
        tokenizer = import_tokenizer(directory, hf, cfg, staging)
        cfg = dataclasses.replace(cfg, tokenizer=tokenizer)
        model = load_sharded(weights, cfg, layout)
        record = {"source": source, "revision": revision, "directory": str(directory),
                  "architecture": (hf.get("architectures") or [None])[0],
                  "weights_dtype": str(weights.dtype)}
        run = RunDir(staging)
        run.write(cfg, None, imported=record)
        checkpointer = Checkpointer(run.checkpoints, async_save=False)
        checkpointer.save(0, model, None, data_state={}, rng=jax.random.key(0))
        checkpointer.wait()
        checkpointer.close()
    arrays = jax.tree.leaves(nnx.state(model, nnx.Param))
    return {"out": out, "config": cfg, "params": count_params(model, cfg),
            "device_bytes": sum(s.data.nbytes for a in arrays for s in a.addressable_shards)}


# --- writing a Hugging Face directory -------------------------------------------------------

def hf_tensors(model, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Our parameters as Hugging Face tensors (float32, vocabulary padding dropped)."""
    state = {key_names(path): np.asarray(jax.device_get(var.get_value()))
             for path, var in jax.tree_util.tree_leaves_with_path(
                 nnx.state(model, nnx.Param), is_leaf=lambda x: isinstance(x, nnx.Variable))}
    parts: dict[str, list] = {}
    hub = mapping(cfg)
    for tensor in hub.tensors(cfg):
        array = state[tensor.path]
        for ids in instances(tensor, cfg):
            piece = to_hf(tensor, array[ids])
            parts.setdefault(hf_name(tensor, ids), []).append(
                (tensor.part[0], piece, 0 if tensor.transpose else -1))
    out = {}
    for name, pieces in parts.items():
        # the pieces' axis: the file's last, which a transposed tensor holds first
        axis = pieces[0][2]
        pieces = [p for _, p, _ in sorted(pieces, key=lambda item: item[0])]
        joined = pieces[0] if len(pieces) == 1 else np.concatenate(pieces, axis=axis)
        out[hub.spelled(name, hub.spellings[0])] = np.ascontiguousarray(joined, np.float32)
    return out


def export_run(run: str | Path, out: str | Path, *, max_file_bytes: int = 2 * 2**30) -> dict:
    """Write a run's latest weights as a Hugging Face model directory; returns a summary.
    An imported run's tokenizer files go back as they came in; the zoo's own tokenizers are
    written as tokenizer.json (`tokenizer_export`)."""
    out = Path(out)
    check_out(out)
    try:
        cfg = RunDir(run).read().model
        enc = load_tokenizer(cfg.tokenizer)
    except LOAD_ERRORS as error:
        raise HubError(str(error)) from None
    ids = tokenizer_files.special_ids(enc)
    begins_with_end = mapping(cfg).begins_with_end  # GPT-2 begins with <|endoftext|> too
    if begins_with_end and ids["bos_token_id"] is None:
        ids["bos_token_id"] = ids["eos_token_id"]
    config = hf_config(cfg, eos=ids["eos_token_id"], bos=ids["bos_token_id"])
    try:
        loaded = load_run(run, "dp", merge_adapters=True)  # a LoRA run's adapters folded in
    except LOAD_ERRORS as error:
        raise HubError(str(error)) from None
    tensors = hf_tensors(loaded.model, cfg)
    with _new_directory(out) as staging:
        files = save_weights(tensors, staging, max_file_bytes=max_file_bytes)
        write_text_atomic(staging / "config.json", json.dumps(config, indent=2) + "\n")
        if isinstance(enc, HFTokenizer):
            tokenizer_files.export_tokenizer_files(enc, staging, cfg.context_len)
        else:
            write_text_atomic(staging / "generation_config.json", json.dumps(ids, indent=2)
                              + "\n")
            eos_token = next((t for t, i in enc.special_tokens.items()
                              if i == ids["eos_token_id"]), None)
            tokenizer_export.write_hf_tokenizer(
                enc, staging, model_max_length=cfg.context_len, eos_token=eos_token,
                bos_token=eos_token if begins_with_end else None)
    return {"out": out, "step": loaded.step, "files": [out / f.name for f in files],
            "bytes": sum(t.nbytes for t in tensors.values())}
