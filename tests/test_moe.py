"""Mixture of experts: the layer against NumPy, capacity dispatch, the same steps under every
preset (expert parallelism included), resume across presets, decoding, the explainer, and bad
requests refused before compiling."""

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import losses, random_batch, refused, tensorboard_scalars
from flax import nnx

import minigpt
from minigpt import explain, generate, sharding, train
from minigpt.config import TrainConfig
from minigpt.models import build_model, count_params, get_config, kernels
from minigpt.models.moe import MoE
from minigpt.optim import lr_schedule, steps
from minigpt.optim import optimizer as optim
from minigpt.parallel import experts
from minigpt.train import metrics

TINY = dataclasses.replace(get_config("moe-tiny"), dropout=0.0)
TRAIN = TrainConfig(steps=10, warmup_steps=4, batch_size=16, lr=1e-3)
RATES = lr_schedule.lr_schedule(TRAIN)


# The layer against NumPy ------------------------------------------------------------------


def first_layer(model) -> MoE:
    graphdef, stacked = nnx.split(model.blocks.layers)
    return nnx.merge(graphdef, jax.tree.map(lambda a: a[0], stacked)).mlp


def weights_of(layer: MoE) -> dict[str, np.ndarray]:
    w = {"router": layer.router.kernel[...], "gate": layer.experts.gate.kernel[...],
         "up": layer.experts.up.kernel[...], "down": layer.experts.down.kernel[...]}
    if layer.shared is not None:
        w.update(shared_gate=layer.shared_gate.kernel[...], s_gate=layer.shared.gate.kernel[...],
                 s_up=layer.shared.up.kernel[...], s_down=layer.shared.down.kernel[...])
    return {k: np.asarray(v, np.float64) for k, v in w.items()}


def swiglu(x, gate, up, down):
    g = x @ gate
    return (g / (1 + np.exp(-g)) * (x @ up)) @ down


def numpy_moe(w, x, k: int, norm_topk: bool, capacity: int | None = None, misrouted=None):
    """A mixture of experts written plainly, token by token: softmax router, top k, weights
    renormalised or not, each chosen expert's SwiGLU, the shared expert behind its sigmoid gate.
    With `capacity`, each sequence's experts take at most that many assignments in token order.
    `misrouted=(b, t, a, c)`: token t of row b goes to expert c where it chose a. Returns the
    outputs and the assignments dropped."""
    B, T, _ = x.shape
    E = w["router"].shape[1]
    out, dropped = np.zeros_like(x), 0
    for b in range(B):
        taken = np.zeros(E, int)
        for t in range(T):
            logits = x[b, t] @ w["router"]
            probs = np.exp(logits - logits.max())
            probs /= probs.sum()
            chosen = np.argsort(-probs, kind="stable")[:k]
            weights = probs[chosen] / (probs[chosen].sum() if norm_topk else 1.0)
            for e, p in zip(chosen, weights):
                if capacity is not None and taken[e] >= capacity:
                    dropped += 1
                    continue
                taken[e] += 1
                if misrouted is not None and misrouted[:3] == (b, t, e):
                    e = misrouted[3]
                out[b, t] += p * swiglu(x[b, t], w["gate"][e], w["up"][e], w["down"][e])
            if "shared_gate" in w:
                gate = 1 / (1 + np.exp(-(x[b, t] @ w["shared_gate"])))
                out[b, t] += gate * swiglu(x[b, t], w["s_gate"], w["s_up"], w["s_down"])
    return out, dropped


def layer_output(layer, x, kernel_set="auto"):
    with sharding.running(kernels=kernel_set):
        y, aux = nnx.jit(lambda m, x: m(x))(layer, jnp.asarray(x, jnp.float32))
    return np.asarray(y, np.float64), jax.tree.map(np.asarray, aux)


@pytest.mark.parametrize("kernel_set, norm_topk", [("cpu", True), ("reference", True),
                                                   ("cpu", False)])
def test_the_layer_equals_a_numpy_mixture_of_experts(kernel_set, norm_topk):
    cfg = dataclasses.replace(TINY, norm_topk_prob=norm_topk)
    layer = first_layer(build_model(cfg, rngs=nnx.Rngs(1)))
    x = np.random.default_rng(0).normal(size=(2, 12, cfg.embed_dim))
    expected, _ = numpy_moe(weights_of(layer), x, cfg.experts_per_token, norm_topk)
    got, aux = layer_output(layer, x, kernel_set)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    # every assignment counted once: 2 tokens' rows x 12 x k
    assert aux["expert_tokens"].sum() == 2 * 12 * cfg.experts_per_token


def test_a_misrouted_token_fails_the_comparison():
    """The comparison above is sharp: one token's first choice sent to another expert (the two
    experts swapped for that token) differs from what the layer computes."""
    layer = first_layer(build_model(TINY, rngs=nnx.Rngs(1)))
    x = np.random.default_rng(0).normal(size=(2, 12, TINY.embed_dim))
    w = weights_of(layer)
    got, _ = layer_output(layer, x)
    logits = x[1, 5] @ w["router"]
    first, unchosen = np.argsort(-logits, kind="stable")[[0, -1]]
    wrong, _ = numpy_moe(w, x, TINY.experts_per_token, True,
                         misrouted=(1, 5, first, unchosen))
    assert not np.allclose(got, wrong, rtol=1e-5, atol=1e-6)
    assert np.abs(got - wrong)[1, 5].max() > 1e-3  # that token, and only it, moved
    np.testing.assert_allclose(np.delete(got, 5, axis=1), np.delete(wrong, 5, axis=1),
                               rtol=1e-5, atol=1e-6)


def test_capacity_drops_only_assignments_over_capacity_and_counts_them():
    x = np.random.default_rng(2).normal(size=(3, 16, TINY.embed_dim))
    for factor, capacity in ((0.5, 2), (1.0, 4), (8.0, 16)):  # ceil(f T k / E), at most T
        cfg = dataclasses.replace(TINY, moe_capacity_factor=factor)
        layer = first_layer(build_model(cfg, rngs=nnx.Rngs(1)))
        assert layer.capacity(16) == capacity
        expected, dropped = numpy_moe(weights_of(layer), x, 2, True, capacity=capacity)
        got, aux = layer_output(layer, x)
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
        assert int(aux["dropped_tokens"]) == dropped
        assert (dropped > 0) == (factor < 8.0)  # a capacity of T drops nothing
    dropless, _ = layer_output(first_layer(build_model(TINY, rngs=nnx.Rngs(1))), x)
    np.testing.assert_allclose(got, dropless, rtol=1e-5, atol=1e-6)


def test_the_cpu_grouped_products_equal_ragged_dot():
    """Groups of every size (one empty), rows past the last group (as the all-to-all's
    buffers have): the CPU kernel's blocks give ragged_dot's values and gradients."""
    M, E, D, F = 300, 5, 16, 24
    keys = jax.random.split(jax.random.key(3), 4)
    x = jax.random.normal(keys[0], (M, D))
    w = [jax.random.normal(k, s) * 0.2 for k, s in zip(keys[1:], [(E, D, F), (E, D, F),
                                                                   (E, F, D)])]
    sizes = jnp.asarray([70, 0, 3, 121, 46], jnp.int32)  # 240 of 300 rows

    def run(name):
        def f(x, *w):
            return jnp.sum(jnp.sin(kernels.get(name).expert_ffn(x, sizes, *w)))
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3)))(x, *w)

    (want, want_grads), (got, got_grads) = run("reference"), run("cpu")
    assert float(got) == pytest.approx(float(want), rel=1e-5)
    for g, r in zip(got_grads, want_grads):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-5)
    assert not np.any(np.asarray(got_grads[0])[240:])  # rows past the groups: no gradient


def test_parameters_name_their_axes_and_the_active_count_takes_k_of_e_experts():
    model = nnx.eval_shape(lambda: build_model(TINY, rngs=nnx.Rngs(0)))
    kernel = model.blocks.layers.mlp.experts.gate.kernel
    assert kernel.shape == (2, 8, 64, 64)  # [L, E, D, F]
    assert kernel.get_metadata()["out_sharding"] == ("layers", "expert", "embed", "mlp")
    assert model.blocks.layers.mlp.experts.down.kernel.shape == (2, 8, 64, 64)  # [L, E, F, D]
    assert model.blocks.layers.mlp.router.kernel.shape == (2, 64, 8)  # [L, D, E]
    in_experts = 2 * 3 * 8 * 64 * 64
    total = count_params(model, TINY)
    assert total - count_params(model, TINY, active=True) == in_experts * 6 // 8
    dense = dataclasses.replace(get_config("llama-cpu"))
    moe = get_config("moe-cpu")
    # moe-cpu uses per token what llama-cpu does, plus its routers
    assert count_params(nnx.eval_shape(lambda: build_model(moe, rngs=nnx.Rngs(0))), moe,
                        active=True) == count_params(nnx.eval_shape(
                            lambda: build_model(dense, rngs=nnx.Rngs(0))), dense) + 4 * 128 * 8


def test_muon_orthogonalises_each_expert_on_its_own():
    path = tuple(jax.tree_util.DictKey(k) for k in ("blocks", "layers", "mlp", "experts", "gate",
                                                    "kernel"))
    dims = optim.muon_dimensions(path, 4)  # [L, E, D, F]
    assert (dims.reduction_axis, dims.output_axis) == (2, (3,))
    down = path[:4] + (jax.tree_util.DictKey("down"), jax.tree_util.DictKey("kernel"))
    dims = optim.muon_dimensions(down, 4)  # [L, E, F, D]
    assert (dims.reduction_axis, dims.output_axis) == ((2,), 3)


# The same steps under every preset ---------------------------------------------------------


def build(cfg):
    model = build_model(cfg, rngs=nnx.Rngs(0))
    return model, nnx.Optimizer(model, optim.make_optimizer(TRAIN), wrt=nnx.Param)


_runs: dict = {}


@pytest.fixture(scope="module", autouse=True)
def _drop_runs():
    """The runs below keep their models on the devices for this file's tests, not the next's."""
    yield
    _runs.clear()


def stepped(preset_name: str, cfg, microbatches: int = 1) -> dict:
    """Three AdamW steps on random batches of 16 sequences of 32 tokens, once per file: their
    metrics, and the model, optimizer, last batch and context they ran in."""
    key = (preset_name, cfg, microbatches)
    if key not in _runs:
        layout = sharding.Layout.make(preset_name).checked(
            model="moe", num_layers=cfg.num_layers, batch_size=16, num_experts=cfg.num_experts)
        model, optimizer = sharding.create_sharded(lambda: build(cfg), layout)
        found = []
        with layout.active():
            for step in range(3):
                batch = sharding.put_batch(random_batch(cfg.vocab_size, 16, 32, step),
                                           layout.batch_sharding())
                found.append(jax.tree.map(np.asarray, steps.train_step(
                    model, optimizer, batch, jax.random.key(0), RATES,
                    microbatches=microbatches)))
        _runs[key] = dict(metrics=found, model=model, optimizer=optimizer, batch=batch,
                          layout=layout)
    return _runs[key]


def three_steps(preset_name: str, cfg, microbatches: int = 1) -> list[dict]:
    """The metrics of `stepped`'s three steps."""
    return stepped(preset_name, cfg, microbatches)["metrics"]


def assert_same_steps(reference, found):
    for ref, got in zip(reference, found, strict=True):
        assert sorted(got) == sorted(ref)
        for name in ("loss", "aux_loss", "grad_norm", "expert_share"):
            np.testing.assert_allclose(got[name], ref[name], rtol=1e-5, err_msg=name)
        if "dropped_tokens" in ref:
            assert int(got["dropped_tokens"]) == int(ref["dropped_tokens"])


def preset_cases():
    """The default run: `ep`; -m slow: the others (`pp` with 8 layers, one per stage)."""
    for name in ("ep", "fsdp_ep", "fsdp", "dp_tp", "pp", "dp_pp"):
        yield pytest.param(name, marks=[] if name in ("ep",) else [pytest.mark.slow])


@pytest.mark.parametrize("name", list(preset_cases()))
def test_three_steps_under_a_preset_equal_data_parallel(name):
    cfg = TINY
    if sharding.load_preset(name).mesh_axes_of("layers"):
        cfg = dataclasses.replace(TINY, num_layers=8)  # one layer per stage under `pp`
    reference = three_steps("dp", cfg)
    assert_same_steps(reference, three_steps(name, cfg))
    # the steps learn, and the router reports a share per expert that sums to 1
    assert reference[-1]["loss"] < reference[0]["loss"]
    assert reference[0]["expert_share"].shape == (8,)
    assert reference[0]["expert_share"].sum() == pytest.approx(1.0)
    assert reference[0]["expert_share_max"] == reference[0]["expert_share"].max()
    # uniform routing would give the minimum, k = 2, of E sum_e f_e P_e
    assert reference[0]["aux_loss"] == pytest.approx(TINY.router_aux_loss_coef * 2, rel=0.05)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ep", "fsdp_ep"])
def test_capacity_dispatch_under_an_expert_axis_equals_data_parallel(name):
    cfg = dataclasses.replace(TINY, moe_capacity_factor=1.0, router_z_loss_coef=1e-3)
    reference = three_steps("dp", cfg)
    assert all(int(r["dropped_tokens"]) > 0 for r in reference)
    assert all(r["z_loss"] > 0 for r in reference)
    assert_same_steps(reference, three_steps(name, cfg))


@pytest.mark.slow
def test_gradient_accumulation_gives_the_same_step():
    """The balance statistics are per sequence, so microbatches change nothing."""
    assert_same_steps(three_steps("dp", TINY), three_steps("dp", TINY, microbatches=4))


def test_the_expert_axis_moves_tokens_by_all_to_all_and_gathers_experts_only_if_crowded():
    # The step the default run's `ep` comparison ran, lowered with what it ran on: the program
    # JAX compiled for it (from its cache, where the lowering is the same).
    run = stepped("ep", TINY)
    model, optimizer = run["model"], run["optimizer"]
    kernel = model.blocks.layers.mlp.experts.gate.kernel.get_value()
    spec = tuple(kernel.sharding.spec)  # after a step JAX writes it without trailing Nones
    assert spec + (None,) * (kernel.ndim - len(spec)) == (None, "expert", None, None)
    assert kernel.addressable_shards[0].data.shape == (2, 1, 64, 64)
    with run["layout"].active():
        text = steps.train_step.lower(model, optimizer, run["batch"], jax.random.key(0), RATES,
                                      microbatches=1).compile().as_text()
    lines = text.splitlines()
    assert sum(" all-to-all(" in line for line in lines) >= 4  # there and back, both passes
    # The experts' weights are gathered only in the branch a crowded step takes (a router that
    # sends one device's experts more rows than the all-to-all buffers hold).
    gathers = [line for line in lines if " all-gather(" in line]
    assert gathers and all("/shard_map/cond/branch_1_fun/" in line for line in gathers)


@pytest.mark.slow  # the default run checks the all-to-all through three steps under `ep`
@pytest.mark.parametrize("routing", ["spread", "all to expert 5"])
def test_dispatch_under_the_expert_axis_equals_dispatch_on_one_device(routing):
    """Tokens spread over the experts travel by all-to-all; when one device's experts are owed
    more rows than the buffers hold, the step gathers the weights instead: the same numbers
    either way, value and gradients."""
    B, T, D, F, E = 16, 8, 16, 24, 8
    keys = jax.random.split(jax.random.key(0), 6)
    x = jax.random.normal(keys[0], (B, T, D))
    chosen = jax.random.randint(keys[1], (B, T, 2), 0, E)
    chosen = chosen.at[..., 1].set((chosen[..., 0] + 1) % E)
    if routing != "spread":
        chosen = chosen.at[..., 0].set(5).at[..., 1].set(6)
    weights = jax.nn.softmax(jax.random.normal(keys[2], (B, T, 2)), axis=-1)
    params = tuple(jax.random.normal(k, s) * 0.1
                   for k, s in zip(keys[3:], [(E, D, F), (E, D, F), (E, F, D)]))

    def loss(x, weights, *params):
        y = experts.dropless(x, chosen, weights, params, kernels.active().expert_ffn)
        return jnp.sum(jnp.sin(y)), y

    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))
    (_, want), want_grads = grad(x, weights, *params)
    layout = sharding.Layout.make("ep")
    with layout.active():
        split = jax.sharding.NamedSharding(layout.mesh, jax.P("expert"))
        placed = [jax.device_put(a, split) for a in (x, weights, *params)]
        (_, got), got_grads = grad(*placed)
        text = grad.lower(*placed).compile().as_text()
    assert " all-to-all(" in text and " all-gather(" in text  # both branches are there
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    for g, w in zip(got_grads, want_grads):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)


# Runs, decoding, the explainer, bad requests ----------------------------------------------


@pytest.fixture
def config(small_stories, tmp_path):
    return TrainConfig(preset="ep", model="moe-tiny", data=(str(small_stories),),
                       data_root=str(tmp_path / "data"), out=str(tmp_path / "run"), steps=4,
                       decay_steps=4, batch_size=16, seq_len=32, lr=3e-3, warmup_steps=1,
                       eval_every=4, eval_batches=1, save_every=2, log_every=1)


@pytest.mark.slow
def test_a_run_resumes_under_another_preset_exactly(config, straight, tmp_path):
    uninterrupted = straight(TINY, config)
    half = dataclasses.replace(config, out=str(tmp_path / "moved"), steps=2)
    train.train(TINY, half, sample=False)
    summary = train.train(TINY, dataclasses.replace(half, steps=4, preset="fsdp"), resume=True,
                          sample=False)
    assert summary["step"] == 4 and summary["eval_loss"] is not None
    np.testing.assert_allclose(losses(tmp_path / "moved"), uninterrupted, rtol=1e-5)
    records = [json.loads(line) for line in (tmp_path / "moved" / "metrics.jsonl").open()]
    shares = [r["expert_share"] for r in records if "loss" in r]
    assert len(shares) == 4 and all(len(s) == 8 and math.isclose(sum(s), 1, rel_tol=1e-5)
                                    for s in shares)
    # Generation from the run: cached decoding under `ep` picks what it does without a mesh.
    model = minigpt.load_run(tmp_path / "moved", "dp").model
    plain = generate.generate_tokens(model, [[464, 3797]], max_new_tokens=6, temperature=0)
    run = minigpt.load_run(tmp_path / "moved", "ep")
    model = run.model
    with run.layout.active():
        assert generate.generate_tokens(model, [[464, 3797]], max_new_tokens=6,
                                        temperature=0) == plain


def test_cached_greedy_decoding_equals_full_recompute():
    model = build_model(TINY, rngs=nnx.Rngs(0))
    prompts = [[464, 3797, 3332], list(range(100, 131))]
    cached = generate.generate_tokens(model, prompts, max_new_tokens=8, temperature=0.0)
    for prompt, tokens in zip(prompts, cached):
        assert tokens == generate.generate_recompute(model, prompt, max_new_tokens=8)[0]


def test_tensorboard_shows_each_experts_share(tmp_path):
    board = metrics.TensorBoard(tmp_path / "tb")
    board.write({"step": 1, "loss": 3.0, "aux_loss": 0.02, "expert_share": [0.75, 0.25],
                 "expert_share_max": 0.75})
    board.close()
    scalars = tensorboard_scalars(tmp_path / "tb")
    assert scalars["experts/share/0"] == [(1, 0.75)] and scalars["experts/share/1"] == [(1, 0.25)]
    assert scalars["experts/largest_share"] == [(1, 0.75)]
    assert scalars["train/router_aux_loss"] == [(1, pytest.approx(0.02))]


def test_the_explainer_shows_which_experts_each_device_holds(capsys):
    assert explain.main(["--model", "moe-tiny", "--preset", "ep"]) == 0
    out = capsys.readouterr().out
    weights = 2 * 3 * 8 * 64 * 64 * 4  # bytes of every layer's experts
    assert (f"experts: 8 over mesh axes ('expert',), 1 per device; expert weights "
            f"{weights // 8:,} bytes per device of {weights:,}; tokens travel to their experts "
            f"by all-to-all") in out
    assert "  expert 0 on device(s) 0\n" in out and "  expert 7 on device(s) 7\n" in out
    assert "blocks.layers.mlp.experts.gate.kernel" in out and "(None, 'expert', None, None)" in out
    assert explain.main(["--model", "moe-tiny", "--preset", "fsdp_ep"]) == 0
    out = capsys.readouterr().out
    assert "experts: 8 over mesh axes ('expert',), 2 per device;" in out
    assert "  experts 0-1 on device(s) 0, 4\n" in out
    assert explain.main(["--model", "moe-tiny", "--preset", "dp"]) == 0
    assert "experts: all 8 on every device (no `expert` rule)" in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["--model", "moe-tiny", "--preset", "ep", "--set", "num_experts=6"],
     "preset 'ep' splits the model's 6 experts over mesh axes ('expert',) of 8 devices, and 8 "
     "does not divide 6"),
    (["--model", "moe-tiny", "--set", "experts_per_token=9"],
     "model.experts_per_token (9) must be between 1 and model.num_experts (8)"),
    (["--model", "moe-tiny", "--set", "moe_capacity_factor=-1"],
     "model.moe_capacity_factor must be > 0 (capacity dispatch) or 0 (dropless), got -1.0"),
    (["--model", "minigpt-tiny", "--set", "num_experts=8"],
     "model.num_experts: a mixture of experts is a llama option; the minigpt architecture has "
     "none"),
    (["--model", "llama-tiny", "--set", "moe_capacity_factor=1.5"],
     "model.moe_capacity_factor: a mixture-of-experts setting, for a model with "
     "model.num_experts > 0"),
    (["--model", "moe-tiny", "--set", "mlp_only_layers=1"],
     "make layer(s) [1] dense: minigpt stacks one kind of layer"),
])
def test_requests_that_cannot_work_are_refused_before_compiling(
        data_dir, tmp_path, capsys, monkeypatch, args, message):
    monkeypatch.setattr(steps, "train_step", lambda *a, **k: pytest.fail("compiled a step"))
    code = train.main(["--data", str(data_dir), "--out", str(tmp_path / "bad"), "--steps", "1",
                       "--batch-size", "16", *args])
    refused(capsys, code, message)
    assert not (tmp_path / "bad").exists()
