"""Pipeline presets: the same losses and gradients as data parallel under every schedule (GPipe,
circular, 1F1B), each device holding only its stage's layers, activations and gradients moved by
collective permutes, 1F1B's memory not growing with the microbatches, runs that move between
schedules and presets through their checkpoints, and bad requests refused before compiling."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import losses, random_batch, refused, small_vocab
from flax import nnx

import minigpt
from minigpt import explain, generate, pipeline, sharding, train
from minigpt.config import TrainConfig
from minigpt.models import build_model, get_config
from minigpt.models.layers import row_keys
from minigpt.models.loss import HOISTED_LOGITS
from minigpt.optim import lr_schedule, steps
from minigpt.optim import optimizer as optim

PIPELINES = ["pp", "dp_pp", "fsdp_pp", "pp_tp", "dp_pp_tp", "fsdp_pp_tp"]
SCHEDULES = {"gpipe": dict(schedule="gpipe"), "1f1b": dict(schedule="1f1b"),
             "circular": dict(schedule="gpipe", repeats=2)}
TRAIN = TrainConfig(steps=10, warmup_steps=4, batch_size=16, lr=1e-3)
RATES = lr_schedule.lr_schedule(TRAIN)
BATCH = 16


def deep(name: str, **changes):
    """A zoo model with 8 layers (one per stage under `pp`), float32, dropout on. Random batches
    need no tokenizer: 8,200 tokens (8,320 with the padding) keep the fused loss in the form
    GPT-2's 50,257 take (above 8,192 it does not keep its logit gradients whole:
    minigpt.models.loss), with a sixth of the output layer."""
    return dataclasses.replace(get_config(name), **{"num_layers": 8, "dropout": 0.1,
                                                    "vocab_size": 8200, **changes})


def build(cfg):
    model = build_model(cfg, rngs=nnx.Rngs(0))
    return model, nnx.Optimizer(model, optim.make_optimizer(TRAIN), wrt=nnx.Param)


def settings(schedule_name: str, microbatches: int = 4) -> sharding.Pipeline:
    return sharding.Pipeline(microbatches=microbatches, **SCHEDULES[schedule_name])


def on(preset_name: str, cfg, plan: sharding.Pipeline | None = None):
    """Model and optimizer born sharded under a preset; with a circular schedule, with their
    layers in its order, as the trainer keeps them."""
    layout = sharding.Layout.make(preset_name)
    model, optimizer = sharding.create_sharded(lambda: build(cfg), layout)
    order = circular_order(layout.mesh, cfg, plan)
    if order is not None:
        for obj in (model, optimizer):
            nnx.update(obj, pipeline.reorder_layers(nnx.state(obj), order))
    return layout.preset, layout.mesh, model, optimizer


_kept: dict = {}


@pytest.fixture(scope="module", autouse=True)
def _drop_kept():
    """The models `kept_on` keeps stay on the devices for this file's tests, not the next's."""
    yield
    _kept.clear()


def kept_on(preset_name: str, cfg, plan: sharding.Pipeline | None = None):
    """`on`, once per file for each preset, model and layer order: for tests that only read the
    model or run it without donating it (a train step would consume what it is given)."""
    key = (preset_name, cfg, plan.repeats if plan else 1)
    if key not in _kept:
        _kept[key] = on(preset_name, cfg, plan)
    return _kept[key]


def circular_order(mesh, cfg, plan):
    if plan is None or plan.repeats == 1:
        return None
    return pipeline.schedules.layer_order(cfg.num_layers, mesh.shape["stage"], plan.repeats)


def placed(preset, mesh, vocab: int, seed: int = 0):
    """A random batch of BATCH sequences of 32 tokens, placed as the preset splits batches."""
    return sharding.put_batch(random_batch(vocab, BATCH, 32, seed),
                              sharding.Layout(preset, mesh).batch_sharding())


def as_host(state) -> dict[str, np.ndarray]:
    return {jax.tree_util.keystr(p): np.asarray(v)
            for p, v in jax.tree_util.tree_leaves_with_path(state)}


_grads: dict = {}


def loss_and_grads(preset_name: str, cfg, plan: sharding.Pipeline | None = None):
    """Loss and every gradient of one batch with dropout (per-row keys), in the model's layer
    order whatever order the schedule keeps them in.

    The masks come from key 7. MiniGPT's ReLU has a kink at 0: a pre-activation within float
    noise of it can take the derivative 0 in one correct computation and 1 in another that sums
    in another order, moving one unit's gradient by a whole row; with key 5's masks one does
    under `dp_pp` (GELU and SiLU models agree to 1e-6 with either key)."""
    key = (preset_name, cfg, plan)
    if key not in _grads:
        preset, mesh, model, _ = kept_on(preset_name, cfg, plan)
        keys = row_keys(jax.random.key(7), BATCH)
        with sharding.Layout(preset, mesh, pipeline=plan or sharding.Pipeline()).active():
            loss, grads = nnx.jit(nnx.value_and_grad(lambda m, b: m.loss(b, keys)))(
                model, placed(preset, mesh, cfg.vocab_size))
        found = as_host(nnx.state(grads))
        order = circular_order(mesh, cfg, plan)
        if order is not None:
            back = np.argsort(order)
            found = {k: v[back] if "'blocks'" in k else v for k, v in found.items()}
        _grads[key] = (float(loss), found)
    return _grads[key]


def parity_cases():
    """Which (model, preset, schedule) triples run. The rule: minigpt-tiny under every pipeline
    preset once, the schedules taken by turns (1F1B, circular, GPipe) so that each meets two
    presets (`pp`, 8 layers on 8 stages, has no room for two chunks each: it takes 1F1B); GPT-2
    and Llama under two presets each, 1F1B and circular. The default run checks minigpt-tiny
    under `pp` with 1F1B (the default schedule, on 8 stages); the circular schedule on a 3-D
    preset is the default run's small-vocabulary case below; `-m slow` runs the rest."""
    turns = ["1f1b", "circular", "gpipe"]
    cases = [("minigpt-tiny", p, turns[i % 3]) for i, p in enumerate(PIPELINES)]
    cases += [("gpt2-tiny", "pp", "1f1b"), ("gpt2-tiny", "fsdp_pp_tp", "circular"),
              ("llama-tiny", "dp_pp", "1f1b"), ("llama-tiny", "pp_tp", "circular")]
    for case in cases:
        quick = case == ("minigpt-tiny", "pp", "1f1b")
        yield pytest.param(*case, marks=[] if quick else [pytest.mark.slow])


@pytest.mark.parametrize("model_name, preset_name, schedule_name", list(parity_cases()))
def test_pipelined_loss_and_every_gradient_equal_data_parallel(model_name, preset_name,
                                                              schedule_name):
    cfg = deep(model_name)
    assert_same_loss_and_gradients(loss_and_grads("dp", cfg),
                                   loss_and_grads(preset_name, cfg, settings(schedule_name)))


@pytest.mark.parametrize("preset_name, schedule_name", [
    pytest.param("dp_pp_tp", "circular", marks=pytest.mark.slow),
    pytest.param("fsdp_tp", None, marks=pytest.mark.slow)])
def test_the_small_vocabulary_loss_equals_data_parallel(preset_name, schedule_name):
    """With TinyStories' 4,096-token vocabulary the CPU loss keeps its logit gradients and pulls
    them back after its loop (minigpt.loss); that form too, split over the vocabulary and
    inside a pipeline stage, gives what `dp` gives. The head runs in the same tick of the loop
    under every schedule; the circular one on a 3-D preset is the default run's only case of
    that schedule (and of Llama in a pipeline)."""
    cfg = deep("llama-tiny", vocab_size=4096)
    assert BATCH * 32 * cfg.padded_vocab <= HOISTED_LOGITS
    plan = settings(schedule_name) if schedule_name else None
    assert_same_loss_and_gradients(loss_and_grads("dp", cfg),
                                   loss_and_grads(preset_name, cfg, plan))


def assert_same_loss_and_gradients(reference, found):
    (ref_loss, ref), (loss, got) = reference, found
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert got.keys() == ref.keys()
    scale = max(float(np.abs(g).max()) for g in ref.values())
    for key, g in ref.items():
        # Relative 1e-5; an absolute floor for the key bias, whose true gradient is 0 and
        # whose computed one is float noise (tests/test_kernels.py says why).
        np.testing.assert_allclose(got[key], g, rtol=1e-5, atol=1e-6 * scale, err_msg=key)


def test_evaluation_runs_the_forwards_alone_and_gives_the_same_loss():
    cfg = deep("minigpt-tiny")  # evaluation draws no dropout masks
    results = {}
    for name, plan in (("dp", None), ("pp", settings("1f1b", 8))):
        preset, mesh, model, _ = kept_on(name, cfg, plan)
        with sharding.Layout(preset, mesh, pipeline=plan or sharding.Pipeline()).active():
            results[name] = float(steps.eval_step(model, placed(preset, mesh, cfg.vocab_size)))
    assert results["pp"] == pytest.approx(results["dp"], rel=1e-6)


# Three steps under the circular schedule are compared with 1F1B's, step by step, in
# test_a_run_moves_between_schedules_and_presets_through_its_checkpoints.
@pytest.mark.slow
@pytest.mark.parametrize("preset_name, schedule_name", [("fsdp_pp", "1f1b")])
def test_three_adamw_steps_agree_with_data_parallel(preset_name, schedule_name):
    # Masks: the parity test; ReLU kinks: its docstring. GPT-2's vocabulary: with 8,200 tokens a
    # few weights of near-zero gradient moved by float noise just past the tolerance.
    cfg = deep("minigpt-tiny", dropout=0.0, vocab_size=get_config("minigpt-tiny").vocab_size)
    params = {}
    for name, plan in (("dp", None), (preset_name, settings(schedule_name))):
        preset, mesh, model, optimizer = on(name, cfg, plan)
        with sharding.Layout(preset, mesh, pipeline=plan or sharding.Pipeline()).active():
            for step in range(3):
                steps.train_step(model, optimizer, placed(preset, mesh, cfg.vocab_size, step),
                                 jax.random.key(0), RATES)
        found = as_host(nnx.state(model, nnx.Param))
        order = circular_order(mesh, cfg, plan)
        if order is not None:
            found = {k: v[np.argsort(order)] if "'blocks'" in k else v for k, v in found.items()}
        params[name] = found
    moved = sum(float(RATES(s)) for s in range(3))  # at most this far
    close = total = 0
    for key, value in params["dp"].items():
        got = params[preset_name][key]
        # Adam's step m / sqrt(v) scales a gradient to about lr whatever its size, so where a
        # gradient is nearly zero its float noise (the same 1e-5 as above) can move a weight by
        # a visible fraction of lr: 1% of the summed step bounds that; the key bias, whose
        # gradient is pure noise, may differ by up to the steps themselves.
        atol = moved if "key']['bias" in key else 0.01 * moved
        np.testing.assert_allclose(got, value, rtol=1e-5, atol=atol, err_msg=key)
        close += int(np.sum(np.abs(got - value) <= 1e-6 + 1e-5 * np.abs(value)))
        total += value.size
    assert close / total > 0.999  # nearly every weight agrees to float32 precision


def step_memory(schedule_name: str, microbatches: int) -> int:
    """Temporary bytes of the compiled train step under `pp_tp` (4 stages, so 1F1B's 2S - 1 = 7
    inputs are all in use from M = 8), 2 sequences of 64 tokens per microbatch of a model 256
    wide, so the stage inputs dominate."""
    cfg = deep("minigpt-tiny", dropout=0.0, embed_dim=256, mlp_dim=256, num_heads=4,
               vocab_size=512, vocab_multiple=8)
    plan = settings(schedule_name, microbatches)
    preset, mesh, model, optimizer = on("pp_tp", cfg, plan)
    batch = sharding.put_batch(random_batch(cfg.vocab_size, 2 * microbatches, 64),
                               sharding.Layout(preset, mesh).batch_sharding())
    with sharding.Layout(preset, mesh, pipeline=plan).active():
        compiled = steps.train_step.lower(model, optimizer, batch, jax.random.key(0),
                                          RATES).compile()
    return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.slow  # six compilations of a 4-stage step
def test_1f1b_memory_does_not_grow_with_microbatches_gpipe_grows_by_a_stage_input_each():
    stage_input = 2 * 64 * 256 * 4  # one microbatch's [2, 64, 256] float32 activations
    for name in ("gpipe", "1f1b"):
        sizes = [step_memory(name, M) for M in (8, 16, 32)]
        growth = [(b - a) / (m2 - m1) for (a, m1), (b, m2) in
                  zip(zip(sizes, (8, 16)), zip(sizes[1:], (16, 32)))]
        if name == "gpipe":
            assert all(0.8 * stage_input < g < 3 * stage_input for g in growth), (sizes, growth)
        else:
            assert all(g < 0.1 * stage_input for g in growth), (sizes, growth)


def test_each_device_holds_only_its_stage_of_the_block_stack():
    for name, stages in (("pp", 8), ("pp_tp", 4)):
        _, mesh, model, optimizer = kept_on(name, deep("minigpt-tiny"))
        blocks = jax.tree.leaves(nnx.state(model.blocks, nnx.Param))
        total = sum(x.nbytes for x in blocks)
        for device in mesh.devices.flat:
            held = sum(s.data.nbytes for x in blocks for s in x.addressable_shards
                       if s.device == device)
            tp = 2 if name == "pp_tp" else 1  # pp_tp also splits heads and units in pairs
            assert held * stages <= total and held * stages * tp >= total
            if name == "pp":
                assert held * stages == total
        mu = optimizer.opt_state[1][0].mu["blocks"]["layers"]["mlp"]["up"]["kernel"]
        assert mu.get_value().sharding.spec[0] == "stage"  # the optimizer state too
        layer_rows = {(s.index[0].start, s.index[0].stop)  # contiguous blocks of layers
                      for s in model.blocks.layers.mlp.up.kernel.get_value().addressable_shards}
        assert sorted(layer_rows) == [(i, i + 8 // stages) for i in range(0, 8, 8 // stages)]


KERNEL = "['blocks']['layers']['mlp']['up']['kernel'].value"


def test_under_the_circular_schedule_stage_s_holds_chunks_s_and_s_plus_S():
    cfg = deep("minigpt-tiny")
    canonical = as_host(nnx.state(kept_on("pp_tp", cfg)[2], nnx.Param))  # the layers in order
    _, mesh, model, optimizer = kept_on("pp_tp", cfg, settings("circular"))  # 4 stages, 8 chunks
    kernel = model.blocks.layers.mlp.up.kernel.get_value()  # [8 layers, D, F]
    for shard in kernel.addressable_shards:
        stage = int(np.argwhere(mesh.devices == shard.device)[0][0])
        held = np.asarray(shard.data)  # this stage's two layers, as stored here
        want = canonical[KERNEL][[stage, 4 + stage]]  # chunks s and S + s
        cols = shard.index[2]
        np.testing.assert_array_equal(held, want[:, :, cols])
    mu = optimizer.opt_state[1][0].mu["blocks"]["layers"]["mlp"]["up"]["kernel"].get_value()
    assert mu.sharding.spec[0] == "stage"


def replica_groups(line: str) -> list[list[int]]:
    explicit = re.search(r"replica_groups=\{(\{[\d,]+\}(?:,\{[\d,]+\})*)\}", line)
    if explicit:
        return [[int(d) for d in g.split(",")] for g in re.findall(r"\{([\d,]+)\}",
                                                                    explicit.group(1))]
    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\], device_ids=\((\S+)\) \{([^}]*)\}", line)
    if mesh:  # mesh form: axis sizes, device ids (iota), the axes the collective runs over
        names = re.findall(r"'(\w+)'=\d+", mesh.group(1))
        sizes = [int(n) for n in re.findall(r"=(\d+)", mesh.group(1))]
        over = [names.index(n) for n in re.findall(r"'(\w+)'", mesh.group(3))]
        ids = iota_ids(mesh.group(2)).reshape(sizes)
        rest = [a for a in range(len(sizes)) if a not in over]
        return ids.transpose(rest + over).reshape(-1, int(np.prod([sizes[a] for a in over])))\
            .tolist()
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\](<=\[[\d,]+\](?:T\([\d,]+\))?)", line)
    assert iota, f"unparsed replica groups: {line[:200]}"
    return iota_ids(iota.group(3)).reshape(int(iota.group(1)), int(iota.group(2))).tolist()


def iota_ids(text: str) -> np.ndarray:
    """Device ids written `<=[dims]` or `[dims]`, with an optional `T(perm)` transposing them."""
    iota = re.fullmatch(r"(?:<=)?\[([\d,]+)\](?:T\(([\d,]+)\))?", text)
    assert iota, f"unparsed device ids: {text}"
    ids = np.arange(np.prod([int(d) for d in iota.group(1).split(",")]))
    ids = ids.reshape([int(d) for d in iota.group(1).split(",")])
    if iota.group(2):
        ids = ids.transpose([int(d) for d in iota.group(2).split(",")])
    return ids


def collectives(text: str, kind: str) -> list[str]:
    """The instructions of an optimized HLO program that are collectives of one kind."""
    return [line for line in text.splitlines()
            if re.search(rf"[\]}})] {kind}(-start)?\(", line)]


@pytest.mark.parametrize("preset_name, schedule_name", [
    ("pp", "1f1b"), pytest.param("fsdp_pp", "1f1b", marks=pytest.mark.slow),
    pytest.param("pp", "gpipe", marks=pytest.mark.slow)])
def test_compiled_step_permutes_both_ways_and_gathers_no_block_weights_across_stages(
        preset_name, schedule_name):
    cfg = deep("minigpt-tiny")
    plan = settings(schedule_name)
    preset, mesh, model, optimizer = kept_on(preset_name, cfg, plan)  # lowered, never run
    stage_of = {d.id: s for s in range(mesh.shape["stage"])
                for d in np.take(mesh.devices, [s], axis=mesh.axis_names.index("stage")).flat}
    with sharding.Layout(preset, mesh, pipeline=plan).active():
        text = steps.train_step.lower(model, optimizer, placed(preset, mesh, cfg.vocab_size),
                                      jax.random.key(0), RATES).compile().as_text()
    # Activations go to the next stage and gradients to the one before: both directions.
    moves = set()
    for line in collectives(text, "collective-permute"):
        pairs = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)+)\}", line)
        moves |= {(stage_of[int(a)], stage_of[int(b)])
                  for a, b in re.findall(r"\{(\d+),(\d+)\}", pairs.group(1))}
    assert (0, 1) in moves and (1, 0) in moves, moves
    # Across stages only the head's share of a microbatch's gradient [b, T/S...] is gathered
    # back into [b, T, D] activations; block weights are gathered, if at all, within a stage.
    activation = f"f32[{BATCH // plan.microbatches},32,{cfg.embed_dim}]"
    gathers = collectives(text, "all-gather")
    within = [line for line in gathers
              if all(len({stage_of[d] for d in g}) == 1 for g in replica_groups(line))]
    across = [line for line in gathers if line not in within]
    assert across, "the head's gradient comes back to the last stage by an all-gather"
    for line in across:
        assert re.search(rf"= {re.escape(activation)}\S* all-gather", line), line[:300]
    assert len(within) >= (10 if preset_name == "fsdp_pp" else 0)


def test_microbatch_helpers_and_the_bubble():
    x = jnp.arange(12).reshape(6, 2)
    split = pipeline.split_microbatches(x, 3)
    assert split.shape == (3, 2, 2) and split[0, :, 0].tolist() == [0, 6]  # every 3rd row
    assert np.array_equal(pipeline.join_microbatches(split), x)
    assert pipeline.bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert pipeline.bubble_fraction(1, 8) == 0.0 and sharding.default_microbatches(4) == 8


def test_explainer_shows_each_stages_layers_the_schedule_and_its_stash(capsys):
    assert explain.main(["--model", "minigpt-tiny8", "--preset", "dp_pp", "--schedule", "gpipe",
                         "--microbatches", "6"]) == 0
    out = capsys.readouterr().out
    assert "pipeline: 2 stages over mesh axis 'stage', 4 layer(s) each" in out
    assert "  stage 0: layers 0-3 on device(s) 0, 1, 2, 3" in out
    assert "  stage 1: layers 4-7 on device(s) 4, 5, 6, 7" in out
    assert ("schedule gpipe, 6 microbatches: bubble (S - 1) / (R M + S - 1) = 1/7 = 14.3% of "
            "each step; each stage keeps up to 6 microbatch inputs for its backward") in out
    assert "blocks.layers.mlp.up.kernel" in out and "('stage', None, None)" in out
    assert explain.main(["--model", "minigpt-tiny8", "--preset", "pp",
                         "--microbatches", "32"]) == 0  # a 1-D mesh, the default schedule
    out = capsys.readouterr().out
    assert "  stage 7: layer 7 on device(s) 7\n" in out
    assert "schedule 1f1b, 32 microbatches" in out
    assert "= 7/39 = 17.9% of each step; each stage keeps up to 15 microbatch inputs" in out
    assert explain.main(["--model", "minigpt-tiny8", "--preset", "dp_pp", "--repeats", "2",
                         "--microbatches", "4"]) == 0
    out = capsys.readouterr().out
    assert "4 layer(s) each in 2 chunks (circular)" in out
    assert "  stage 0: layers 0-1, 4-5 on device(s) 0, 1, 2, 3" in out
    assert "schedule gpipe, repeats 2, 4 microbatches: bubble (S - 1) / (R M + S - 1) = 1/9" in out


# Training runs: resume across pipelined and unpipelined presets, bad requests ---------------


MODEL = small_vocab("minigpt-tiny8")  # the TinyStories vocabulary: these runs test resuming


@pytest.fixture
def config(data_4k, tmp_path):
    return TrainConfig(preset="pp", model="minigpt-tiny8", data=(str(data_4k),),
                       out=str(tmp_path / "run"), steps=6, decay_steps=6, batch_size=16,
                       seq_len=32, lr=3e-3, warmup_steps=2, eval_every=6, eval_batches=1,
                       save_every=3, log_every=1, pipeline_microbatches=8)


@pytest.mark.slow  # dp -> pp: the schedules test below
def test_a_run_moves_from_a_pipelined_preset_to_an_unpipelined_one(config, straight):
    uninterrupted = straight(MODEL, config)
    half = dataclasses.replace(config, preset="pp", steps=3)
    train.train(MODEL, half, sample=False)
    summary = train.train(MODEL, dataclasses.replace(half, preset="dp", steps=6), resume=True,
                          sample=False)
    assert summary["step"] == 6 and summary["eval_loss"] is not None
    np.testing.assert_allclose(losses(config.out), uninterrupted, rtol=1e-5)
    # Generation under a pipeline preset, from what either layout wrote.
    run = minigpt.load_run(config.out, "pp")
    with run.layout.active():
        piped = generate.generate_tokens(run.model, [[464, 3797]], max_new_tokens=6, temperature=0)
    plain = minigpt.load_run(config.out, "dp").model
    assert piped == generate.generate_tokens(plain, [[464, 3797]], max_new_tokens=6,
                                             temperature=0)


@pytest.mark.slow  # three runs of a 16-layer model, two of them on 8 pipeline stages
def test_a_run_moves_between_schedules_and_presets_through_its_checkpoints(data_4k, tmp_path):
    """6 steps under `pp` with 1F1B are 3 under `dp` and 3 more resumed under `pp` with the
    circular schedule (16 layers: 2 chunks on each of 8 stages)."""
    model = small_vocab("minigpt-tiny", num_layers=16)
    one = TrainConfig(preset="pp", model="minigpt-tiny", data=(str(data_4k),),
                      out=str(tmp_path / "straight"), steps=6, decay_steps=6, batch_size=16,
                      seq_len=32, lr=3e-3, warmup_steps=2, eval_every=6, eval_batches=1,
                      save_every=3, log_every=1, pipeline_microbatches=8,
                      pipeline_schedule="1f1b")
    train.train(model, one, sample=False)
    first = dataclasses.replace(one, preset="dp", steps=3, pipeline_schedule="gpipe",
                                out=str(tmp_path / "run"))
    train.train(model, first, sample=False)
    summary = train.train(model, dataclasses.replace(first, preset="pp", steps=6,
                                                     pipeline_repeats=2), resume=True,
                          sample=True)
    assert summary["step"] == 6 and summary["eval_loss"] is not None
    np.testing.assert_allclose(losses(first.out), losses(one.out), rtol=1e-5)
    # What the circular run saved is in the model's layer order, as the 1F1B run's is: layer
    # by layer the weights agree. A layer out of place would differ by its whole init, nearly
    # every entry by more than 1e-3; here under 1% of each layer's entries may. Not every entry
    # agrees: AdamW moves a weight by about the learning rate whatever its gradient's size, so a
    # gradient near zero whose sign depends on the order of a sum moves its weight up to twice
    # the rate (3e-3) the other way; a slow run with GPT-2's vocabulary saw 7 of its 3,219,456
    # token-table entries do so.
    saved = {}
    for name in ("run", "straight"):
        restored = minigpt.load_run(tmp_path / name, "dp").model
        saved[name] = as_host(nnx.state(restored, nnx.Param))
    for key, value in saved["straight"].items():
        moved = np.abs(saved["run"][key] - value) > 1e-3
        per_layer = moved.reshape(model.num_layers if "['blocks']" in key else 1, -1).mean(1)
        assert (per_layer < 0.01).all(), (key, per_layer)


@pytest.mark.parametrize("args, message", [
    (["--model", "minigpt-tiny8", "--preset", "pp", "--set", "pipeline_repeats=2"],
     "train.pipeline_repeats 2 does not divide the 1 layer(s) each of the 8 stages holds"),
    (["--model", "minigpt-tiny8", "--preset", "dp_pp", "--set", "pipeline_repeats=2",
      "--set", "pipeline_microbatches=1"],
     "the circular schedule needs at least as many microbatches as stages"),
    (["--model", "minigpt-tiny8", "--preset", "dp_pp", "--set", "pipeline_schedule=zigzag"],
     "unknown train.pipeline_schedule 'zigzag': choose one of gpipe, 1f1b"),
    (["--model", "minigpt-tiny8", "--preset", "dp_pp", "--set", "pipeline_schedule=1f1b",
      "--set", "pipeline_repeats=2"],
     "train.pipeline_repeats 2 (the circular schedule) runs with train.pipeline_schedule=gpipe"),
    (["--model", "minigpt-tiny8", "--preset", "pp", "--seq-len", "36"],
     "train.seq_len 36 does not divide by the 8 pipeline stages"),
    (["--model", "minigpt-tiny", "--preset", "pp"],
     "preset 'pp' splits the layers into 8 pipeline stages, but model 'minigpt-tiny' has 2 "
     "layer(s)"),
    (["--model", "minigpt-tiny8", "--preset", "pp", "--set", "num_layers=1"],
     "model 'minigpt-tiny8' has 1 layer(s), which 8 stages cannot share evenly"),
    (["--model", "minigpt-tiny8", "--preset", "dp_pp", "--set", "pipeline_microbatches=3"],
     "train.pipeline_microbatches 3 does not divide the 16 sequences"),
    (["--model", "minigpt-tiny8", "--preset", "dp_pp", "--set", "pipeline_microbatches=8"],
     "gives 2 sequences per piece, which preset 'dp_pp' must split 4 ways"),
])
def test_pipeline_requests_that_cannot_work_are_refused_before_compiling(
        data_dir, tmp_path, capsys, monkeypatch, args, message):
    monkeypatch.setattr(steps, "train_step", lambda *a, **k: pytest.fail("compiled a step"))
    code = train.main(["--data", str(data_dir), "--out", str(tmp_path / "bad"), "--steps", "1",
                       "--batch-size", "16", *args])
    refused(capsys, code, message)
    assert not (tmp_path / "bad").exists()
