"""minigpt: a Flax NNX model zoo for GPT-style pre-training with interchangeable parallelism
presets.

The names below are the public API, what notebooks and scripts rely on; the modules behind them
may move. Importing `minigpt` is cheap: each name loads its module when first used.

    import minigpt

    cfg = minigpt.get_config("llama-tiny")                  # a zoo model's ModelConfig
    summary = minigpt.train(cfg, minigpt.TrainConfig(model="llama-tiny", preset="fsdp",
                                                     steps=200, out="runs/demo"))
    run = minigpt.load_run("runs/demo")                     # its latest weights, laid out by `dp`
    with run.layout.active():
        stories = minigpt.generate(run.model, run.tokenizer, ["Once upon a time"],
                                   max_new_tokens=100, rng=jax.random.key(0))

    layout = minigpt.Layout.make("fsdp")                    # a preset over the devices, and a
    model = minigpt.create_sharded(                         # model born sharded under it
        lambda: minigpt.build_model(cfg, rngs=nnx.Rngs(0)), layout)

    data_dir = minigpt.prepare_data(["my_stories.txt"], tokenizer=cfg.tokenizer)
    minigpt.import_checkpoint("HuggingFaceTB/SmolLM2-135M-Instruct", "runs/smol")
    smol = minigpt.load_run("runs/smol")
    reply = minigpt.chat(smol.model, smol.tokenizer, [{"role": "user", "content": "Hi!"}])
    minigpt.export_run("runs/smol", "exported/smol")
    minigpt.export_adapter("runs/smol-lora", "exported/smol-lora")  # a LoRA run, for PEFT
"""

from __future__ import annotations

import importlib
import types

# Public name -> the module that defines it (and its name there, where it differs).
_PUBLIC = {
    "ModelConfig": "minigpt.config",
    "TrainConfig": "minigpt.config",
    "get_config": "minigpt.models",
    "build_model": "minigpt.models",
    "Layout": "minigpt.sharding",
    "UserError": "minigpt.errors",
    "load_preset": "minigpt.sharding",
    "make_mesh": "minigpt.sharding",
    "create_sharded": "minigpt.sharding",
    "load_run": "minigpt.runs",
    "LoadedRun": "minigpt.runs",
    "chat": "minigpt.generate",
    "load_tokenizer": "minigpt.tokenizer",
    "prepare_data": ("minigpt.data", "resolve_data"),
    "import_checkpoint": "minigpt.hub",
    "export_run": "minigpt.hub",
    "export_adapter": "minigpt.hub",
    "import_adapter": "minigpt.hub",
}

__all__ = [*_PUBLIC, "generate", "train"]


class CallableModule(types.ModuleType):
    """A module that is also its function of the same name: `minigpt.train` is a package and
    `minigpt.train(...)` trains, `minigpt.generate` a module and `minigpt.generate(...)` tells
    stories. A module becomes one by assigning its `__class__` (Python's documented way to give a
    module behaviour), so the name means the same whether the module was imported or not."""

    def __call__(self, *args, **kwargs):
        return getattr(self, self.__name__.rpartition(".")[2])(*args, **kwargs)


def __getattr__(name: str):
    if name in ("train", "generate"):  # modules that are also their functions
        return importlib.import_module(f"minigpt.{name}")
    if name in _PUBLIC:
        module, attribute = _PUBLIC[name] if isinstance(_PUBLIC[name], tuple) else (
            _PUBLIC[name], name)
        return getattr(importlib.import_module(module), attribute)
    raise AttributeError(f"module 'minigpt' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
