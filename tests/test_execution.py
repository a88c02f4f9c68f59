"""How a model runs on each backend (`minigpt.models.execution`) and what a run resolves once
(`minigpt.runs.resolved`): every "auto" made concrete by the rules the module states, for a
CPU, a GPU and a TPU, without one attached; the XLA flags set for a GPU; the record config.json
keeps of what was resolved."""

import dataclasses
import os
import re

import jax
import pytest

from minigpt import runtime, sharding
from minigpt.config import ConfigError, ModelConfig, TrainConfig
from minigpt.models import execution, get_config
from minigpt.runs import resolved

# One row per backend: what "auto" means there (the module docstring's rules).
AUTO = {"cpu": dict(dtype="float32", kernels="cpu", scan_layers=True),
        "gpu": dict(dtype="bfloat16", kernels="cudnn", scan_layers=False),
        "tpu": dict(dtype="bfloat16", kernels="splash", scan_layers=False)}


@pytest.mark.parametrize("platform", AUTO)
def test_auto_resolves_by_the_rule_on_each_backend(platform):
    cfg = get_config("gpt2-small")
    assert (cfg.dtype, cfg.kernels, cfg.scan_layers, cfg.remat) == ("auto",) * 4  # the zoo's
    got = execution.for_backend(cfg, platform)
    assert {k: getattr(got, k) for k in AUTO[platform]} == AUTO[platform]
    assert got.remat == "none"  # unless the run's resolver passes the planner's choice
    assert execution.for_backend(cfg, platform, remat="full").remat == "full"
    # what the user set is kept, "auto" or not: llama-cpu's scan_layers=False, a float32 run
    kept = dataclasses.replace(get_config("llama-cpu"), dtype="float32", remat="minimal")
    got = execution.for_backend(kept, platform)
    assert (got.scan_layers, got.dtype, got.remat) == (False, "float32", "minimal")


def test_remat_policies_and_the_settings_of_older_runs():
    assert execution.remat_policy("none") is None
    assert execution.remat_policy("full") is jax.checkpoint_policies.nothing_saveable
    minimal = execution.remat_policy("minimal")
    assert minimal is jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    # config.json of runs from before the policies: true and false
    assert ModelConfig(remat=True).remat_policy == "full"
    assert ModelConfig(remat=False).remat_policy == "none"
    assert ModelConfig(scan_layers=True).scan_layers is True
    with pytest.raises(ConfigError, match="model.remat must be one of"):
        ModelConfig(remat="sometimes")


def test_a_run_resolves_its_settings_once_and_records_both():
    model_cfg = get_config("minigpt-tiny")
    train_cfg = TrainConfig(model="minigpt-tiny", preset="fsdp", batch_size=8, steps=50,
                            lora_rank=4)
    layout = resolved.layout(model_cfg, train_cfg)
    settled = resolved.resolve(model_cfg, train_cfg, layout, platform="gpu", remat="full")
    assert settled.seq_len == model_cfg.context_len == 128  # train.seq_len 0: the context
    assert settled.warmup_steps == 5  # -1: a tenth of 50 steps
    assert settled.adapters.rank == 4 and settled.layout is layout
    record = settled.record()
    assert {k: record[k] for k in ("seq_len", "warmup_steps", "dtype", "kernels", "scan_layers",
                                   "remat", "preset")} == {
        "seq_len": 128, "warmup_steps": 5, "dtype": "bfloat16", "kernels": "cudnn",
        "scan_layers": False, "remat": "full", "preset": "fsdp"}
    assert record["pipeline"] is None and record["lora"]["rank"] == 4
    # a time budget's warm-up comes from the horizon the planner estimates, never the end
    budgeted = dataclasses.replace(train_cfg, time_budget=60.0, steps=10**9)
    assert resolved.warmup_steps(budgeted, horizon=300) == 30
    assert resolved.warmup_steps(budgeted, horizon=10**6) == 100


def test_the_layout_is_one_value():
    layout = sharding.Layout.make("dp_tp")
    assert (layout.name, dict(layout.mesh.shape)) == ("dp_tp", {"data": 4, "model": 2})
    assert layout.batch_divisor == 4 and layout.stages == 1
    with layout.active():
        assert sharding.active().rules == layout.rules
    assert not hasattr(sharding, "use_preset")  # the spelling before layouts is gone
    with pytest.raises(TypeError, match="takes a Layout"):
        sharding.create_sharded(lambda: None, "dp")


def test_gpu_flags_are_added_only_with_a_gpu_and_never_over_the_users(monkeypatch, tmp_path):
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_triton_gemm=true")
    monkeypatch.setattr(runtime, "_gpu_flags_set", [])
    monkeypatch.setenv("PATH", os.environ["PATH"])  # restored after
    assert runtime.set_gpu_flags() == []  # no nvidia-smi on the PATH: no GPU, nothing
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    added = runtime.set_gpu_flags()
    assert added == ["--xla_gpu_enable_latency_hiding_scheduler=true"]
    assert os.environ["XLA_FLAGS"] == ("--xla_gpu_enable_triton_gemm=true "
                                       "--xla_gpu_enable_latency_hiding_scheduler=true")
    assert "latency_hiding_scheduler=true" in runtime.gpu_flags_note()
    monkeypatch.setenv("MINIGPT_GPU_FLAGS", "0")
    monkeypatch.setenv("XLA_FLAGS", "")
    assert runtime.set_gpu_flags() == []


def test_remat_auto_is_the_first_policy_the_planner_finds_fitting_and_a_misfit_is_refused():
    from minigpt import plan

    model_cfg = dataclasses.replace(get_config("gpt2-tiny"), vocab_size=4096)
    train_cfg = TrainConfig(model="gpt2-tiny", preset="dp", batch_size=64, seq_len=128)
    layout = resolved.layout(model_cfg, train_cfg)
    need = {policy: plan.estimate(dataclasses.replace(model_cfg, remat=policy), train_cfg, "dp",
                                  8, headroom=0.0).total for policy in ("none", "full")}
    assert need["full"] < need["none"]
    between = (need["full"] + need["none"]) // 2
    with plan.budget(between):
        assert plan.preflight(model_cfg, train_cfg, layout).remat == "full"
    with plan.budget(need["none"] * 2):
        assert plan.preflight(model_cfg, train_cfg, layout).remat == "none"
    with plan.budget(need["full"] // 2), pytest.raises(ConfigError, match="needs about"):
        plan.preflight(model_cfg, train_cfg, layout)
    said = []
    with plan.budget(need["full"] // 2):  # told to go on anyway: a warning, then the plan
        assert plan.preflight(model_cfg, train_cfg, layout, enforce=False,
                              say=said.append).remat == "full"
    assert said and said[0].startswith("warning: preset dp needs about")


def test_a_cpu_runs_auto_dtype_takes_bfloat16_operands_where_they_measure_faster(monkeypatch):
    """`model.dtype` auto on a CPU: bfloat16 operands (float32 accumulation, float32 elsewhere)
    where this machine's bfloat16 products measure at least 1.5x its float32 ones, float32
    otherwise, and the run says which and why; given dtypes are kept."""
    cfg, train_cfg, layout = get_config("llama-tiny"), TrainConfig(), sharding.Layout.make("dp")
    for speedup, dtype in (("4.2", "bfloat16"), ("1.4", "float32")):
        monkeypatch.setenv("MINIGPT_BFLOAT16_SPEEDUP", speedup)
        settled = resolved.resolve(cfg, train_cfg, layout, platform="cpu")
        assert settled.model.dtype == dtype
        assert settled.dtype_reason.startswith(f"auto: bfloat16 products run {speedup}x")
    forced = resolved.resolve(dataclasses.replace(cfg, dtype="float32"), train_cfg, layout,
                              platform="cpu")
    assert (forced.model.dtype, forced.dtype_reason) == ("float32", "")
    assert resolved.training_dtype("auto", "gpu") == ("bfloat16", "")  # accelerators: as before
    # what a CPU's bfloat16 means: float32 activations, bfloat16 operands
    assert (execution.compute_dtype("bfloat16", "cpu"), execution.operand_dtype(
        "bfloat16", "cpu")) == ("float32", "bfloat16")
    assert execution.compute_dtype("bfloat16", "gpu") == "bfloat16"


def _dots(hlo: str) -> list[tuple[str, str, str]]:
    """(result dtype, operand dtypes) of every dot in optimised HLO text."""
    found, types = [], {}
    for line in hlo.splitlines():
        if line.rstrip().endswith("{") and "->" in line:  # a computation starts
            types = {}
        defined = re.match(r"\s*(?:ROOT\s+)?%([\w.\-]+) = (\w+)\[", line)
        if defined:
            types[defined.group(1)] = defined.group(2)
            dot = re.search(r"\bdot\(%([\w.\-]+), %([\w.\-]+)\)", line)
            if dot:
                found.append((defined.group(2), types.get(dot.group(1)),
                              types.get(dot.group(2))))
    return found


def test_a_cpu_bfloat16_step_has_no_product_with_bfloat16_outputs():
    """A CPU's bfloat16 training step (loss and gradients, compiled): its projections,
    attention and gated layer multiply bfloat16 operands into float32, and no product gives
    bfloat16, which runs below float32 there (bench/RESULTS.md, 2026-12-02)."""
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from minigpt.models import build_model, replaced
    from minigpt.optim import steps

    cfg = replaced(get_config("llama-tiny"), dtype="bfloat16", vocab_size=512,
                   tokenizer="tinystories-4k")
    graphdef, state = nnx.split(build_model(cfg, rngs=nnx.Rngs(0)))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 512, (2, 129)), jnp.int32)

    def grads(state, batch):
        model = nnx.merge(graphdef, state)
        return steps.loss_and_grads(model, steps.loss_batch(batch), None, 1)[1]

    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    dots = _dots(jax.jit(grads).lower(state, batch).compile().as_text())
    assert not [d for d in dots if d[0] == "bf16"]
    mixed = [d for d in dots if d == ("f32", "bf16", "bf16")]
    # the scanned block's four projections and two attention products forward, its gated
    # layer's two forward and four backward, the attention's four backward, and the head's
    assert len(mixed) >= 17, dots
