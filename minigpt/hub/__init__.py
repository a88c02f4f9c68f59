"""Hugging Face checkpoints in and out: `python -m minigpt.hub import|export`.

The package's modules: `convert` (a Hugging Face directory becomes a run, a run becomes a
directory `transformers` loads), `architectures` (how each Hugging Face architecture's
config.json and tensors map to minigpt's), `safetensors` (the weights files, memory-mapped),
`tokenizer_files` and `tokenizer_export` (the tokenizer files), `peft` (LoRA adapters as PEFT
adapter folders, out and in) and `cli` (the command line).
"""

from minigpt.hub.architectures import HubError
from minigpt.hub.cli import main
from minigpt.hub.convert import export_run, import_checkpoint
from minigpt.hub.peft import export_adapter, import_adapter

__all__ = ["HubError", "export_adapter", "export_run", "import_adapter", "import_checkpoint",
           "main"]
