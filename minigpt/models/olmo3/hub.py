"""OLMo 3 in the Hugging Face layout: `Olmo3ForCausalLM` (`model_type` "olmo3"), as
allenai/Olmo-3-1025-7B spells its config.json: OLMo 2's block and tensors, with sliding-window
attention by layer (`layer_types`, three sliding to one full by default, and `sliding_window`)
and rotary settings per kind of layer (`rope_parameters`, or `rope_theta` and a `rope_scaling`
of the full layers in older files). Scaled rotary frequencies (the 7B's YaRN on its full
layers) are refused by name until minigpt implements them."""

from __future__ import annotations

from typing import Any

from minigpt.config import ModelConfig
from minigpt.models.family import FULL, SLIDING, HFConfig, HubError, HubMapping, layer_types
from minigpt.models.llama.hub import rope_fields
from minigpt.models.olmo2.hub import common_config, common_fields, refuse_unimplemented, tensors


def read(hf: HFConfig) -> ModelConfig:
    refuse_unimplemented(hf, "olmo3")
    layers = hf.number("num_hidden_layers", 32)
    window, pattern = hf.windows(layers, hf.number("sliding_window", 4096), 4)
    params = hf.get("rope_parameters")
    theta = hf.number("rope_theta", 10000.0, float)
    if isinstance(params, dict) and (SLIDING in params or FULL in params):
        kinds = {kind: rope_fields(hf, params.get(kind) or {}, theta, kinds=())
                 for kind in (SLIDING, FULL)}
    else:  # one set for every layer, or the older spelling (a scaling of the full layers)
        rope = params or {**(hf.get("rope_scaling") or {}), "rope_theta": theta}
        kinds = {kind: rope_fields(hf, rope, theta, kinds=()) for kind in (SLIDING, FULL)}
    if kinds[SLIDING] != kinds[FULL]:
        raise hf.fail(f"has rotary bases {kinds[SLIDING]['rope_theta']:g} (sliding layers) and "
                      f"{kinds[FULL]['rope_theta']:g} (full layers): minigpt's olmo3 rotates "
                      f"every layer at one base")
    fields = common_fields(hf, "olmo3")
    if fields["context_len"] <= window:
        window, pattern = 0, 0  # a window past the context slides nothing
    return hf.built(**fields, sliding_window=window, sliding_window_pattern=pattern,
                    **kinds[FULL])


def write(cfg: ModelConfig, common: dict[str, Any]) -> dict[str, Any]:
    if cfg.sliding_window and not cfg.sliding_window_pattern:
        raise HubError("Olmo3ForCausalLM has full layers: an olmo3 model whose every layer "
                       "slides (model.sliding_window_pattern 0) has no Hugging Face class")
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    return {"architectures": ["Olmo3ForCausalLM"], "model_type": "olmo3",
            "rope_parameters": {SLIDING: rope, FULL: rope}, "rope_theta": cfg.rope_theta,
            # transformers' class wants a window even where no layer slides: the context
            "sliding_window": cfg.sliding_window or cfg.context_len,
            "layer_types": layer_types(cfg), **common_config(cfg, common)}


MAPPING = HubMapping(model_types=("olmo3",), read=read, write=write, tensors=tensors,
                     tied=lambda cfg: cfg.tie_embeddings)
