"""A mixture of experts: the feed-forward of the llama family's sparse layers.

A router (one [D, E] projection, in float32) gives each token a softmax over E experts; the
token goes to the k with the highest probabilities, their weights renormalised to sum to 1 where
`norm_topk_prob` says so (Mixtral, Qwen3-MoE) and left as they are where not (Qwen2-MoE, OLMoE).
Each expert is a SwiGLU of width F; the layer's output is the weighted sum of its k experts'
outputs, plus, where the model has one, a shared expert that sees every token, scaled by a
sigmoid gate (Qwen2-MoE). Parameter names follow the checkpoints' roles: `router` (Hugging
Face's `mlp.gate`), `experts.gate`, `experts.up`, `experts.down` (each expert's `gate_proj`,
`up_proj`, `down_proj`, stacked [E, ...] and, in the block stack, [L, E, ...]), `shared`
(`shared_expert`) and `shared_gate` (`shared_expert_gate`).

Two dispatches. Dropless (the default): every assignment is computed, sorted by expert into
grouped products (`minigpt.parallel.experts`, which also moves tokens to experts on other
devices). Capacity (`moe_capacity_factor` > 0): each expert takes at most C = ceil(factor * T k /
E) assignments of each sequence, earliest tokens first (so dropping stays causal), into a buffer
[B, E, C, D] that runs as dense batched products; the rest are dropped and counted. Decoding
always runs dropless: a cached step sees too few tokens to apply a sequence's capacity.

Each layer reports what the loss needs (`aux`): the router's penalties as sums over positions,
already weighted and averaged over the layers, like the head's cross-entropy summed (floats:
the load-balancing loss E * sum_e f_e P_e of Switch and Mixtral, computed per sequence, and the
z-loss), and counts (ints: assignments per expert, assignments dropped). Taken per sequence,
every statistic is a sum over rows, so a batch split over devices, microbatches or pipeline
stages gives the same loss. Dimension letters as in `minigpt.models.layers`, plus E experts,
C capacity and F an expert's width; k is the number of experts per token.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

import minigpt.models.kernels as kernels
from minigpt.config import ModelConfig
from minigpt.models.layers import Dense
from minigpt.parallel import experts as dispatch
from minigpt.sharding import constrain

normal = nnx.initializers.normal(0.02)

# The module holding the experts' weights, stacked [E, ...]: the optimizer treats each expert's
# matrices as matrices of their own (minigpt.optim.optimizer.muon_dimensions).
STACKED_EXPERTS = "experts"


def top_k(probs: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """`jax.lax.top_k` over the experts as k rounds of argmax (the lower index first among
    equals, as top_k): XLA partitions an argmax over a split batch where it is, and gathered
    every token's probabilities to every device for top_k."""
    values, indices = [], []
    for _ in range(k):
        i = jnp.argmax(probs, axis=-1)  # [B, T]
        values.append(jnp.take_along_axis(probs, i[..., None], axis=-1)[..., 0])
        indices.append(i.astype(jnp.int32))
        probs = jnp.where(jax.nn.one_hot(i, probs.shape[-1], dtype=bool), -jnp.inf, probs)
    return jnp.stack(values, axis=-1), jnp.stack(indices, axis=-1)


def whole(projection: Dense) -> jax.Array:
    """A projection's kernel [D, n] gathered whole (they are small: the router's [D, E], the
    shared expert's gate [D, 1]). Inside a pipeline stage with two more mesh axes (fsdp_pp_tp),
    XLA partitioned a product with a kernel split by `embed` alone into collectives that
    deadlocked."""
    return constrain(projection.kernel[...], (None, None))


class Experts(nnx.Module):
    """E SwiGLU experts, their weights stacked along a leading `expert` axis."""

    def __init__(self, cfg: ModelConfig, *, out_init, rngs: nnx.Rngs):
        E, D, F = cfg.num_experts, cfg.embed_dim, cfg.expert_dim
        common = dict(use_bias=False, dtype=cfg.dtype, rngs=rngs)
        into = ("expert", "embed", "mlp")
        self.gate = Dense("BECD,EDF->BECF", (E, D, F), into, init=normal, **common)
        self.up = Dense("BECD,EDF->BECF", (E, D, F), into, init=normal, **common)
        self.down = Dense("BECF,EFD->BECD", (E, F, D), ("expert", "mlp", "embed"),
                          init=out_init, **common)

    def weights(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        """gate, up [E, D, F] and down [E, F, D] in the compute dtype, rounded as the layers'
        products round their operands (a CPU's bfloat16: to bfloat16, computed in float32)."""
        return tuple(w.kernel[...].astype(w.operands).astype(w.dtype)
                     for w in (self.gate, self.up, self.down))

    def __call__(self, buffer: jax.Array) -> jax.Array:
        """Each expert on its own rows of a buffer [B, E, C, D]."""
        return self.down(jax.nn.silu(self.gate(buffer)) * self.up(buffer))


class MoE(nnx.Module):
    """The sparse feed-forward: router, experts, optional shared expert (`shared`, a module
    [B, T, D] -> [B, T, D] the caller builds: llama's SwiGLU)."""

    def __init__(self, cfg: ModelConfig, *, out_init, shared: nnx.Module | None,
                 rngs: nnx.Rngs):
        D, E = cfg.embed_dim, cfg.num_experts
        self.router = Dense("BTD,DE->BTE", (D, E), ("embed", None), init=normal,
                            use_bias=False, dtype="float32", rngs=rngs)
        self.experts = Experts(cfg, out_init=out_init, rngs=rngs)
        self.shared = shared
        self.shared_gate = None if shared is None else Dense(
            "BTD,DO->BTO", (D, 1), ("embed", None), init=normal, use_bias=False,
            dtype=cfg.dtype, rngs=rngs)
        self.top_k, self.norm_topk, self.capacity_factor = (
            cfg.experts_per_token, cfg.norm_topk_prob, cfg.moe_capacity_factor)
        # Penalties are averaged over the sparse layers (every layer: see ModelConfig).
        self.aux_coef = cfg.router_aux_loss_coef / cfg.num_layers
        self.z_coef = cfg.router_z_loss_coef / cfg.num_layers

    def __call__(self, x: jax.Array, *, dropless: bool = False):
        """x [B, T, D] -> (y [B, T, D], aux); `dropless` forces the dropless dispatch."""
        logits = jnp.einsum("btd,de->bte", x.astype(jnp.float32), whole(self.router))  # [B, T, E]
        probs = jax.nn.softmax(logits, axis=-1)
        weights, chosen = top_k(probs, self.top_k)  # [B, T, k]
        if self.norm_topk:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        weights = weights.astype(x.dtype)
        dropped = None
        if self.capacity_factor and not dropless:
            y, dropped = self.capacity_dispatch(x, chosen, weights)
        else:
            y = dispatch.dropless(x, chosen, weights, self.experts.weights(),
                                  kernels.active().expert_ffn)
        if self.shared is not None:
            ops = self.shared_gate.operands  # a CPU's bfloat16: bfloat16 operands, into x's
            gate = jnp.einsum("btd,do->bto", x.astype(ops), whole(self.shared_gate).astype(ops),
                              preferred_element_type=x.dtype)
            y = y + jax.nn.sigmoid(gate) * self.shared(x)
        return y, self.aux(logits, probs, chosen, dropped)

    def capacity(self, T: int) -> int:
        """Assignments each expert takes from a sequence of T tokens."""
        E = self.experts.gate.kernel.shape[0]
        return min(T, math.ceil(self.capacity_factor * T * self.top_k / E))

    def capacity_dispatch(self, x, chosen, weights):
        """Each sequence's assignments into a buffer [B, E, C, D], in token order (a token's k
        choices together), those past an expert's C dropped; returns the weighted outputs
        [B, T, D] and how many assignments were dropped."""
        B, T, D = x.shape
        E, k = self.experts.gate.kernel.shape[0], self.top_k
        C = self.capacity(T)
        flat = chosen.reshape(B, T * k)  # [B, Tk]
        hits = jax.nn.one_hot(flat, E, dtype=jnp.int32)  # [B, Tk, E]
        rank = jnp.sum((jnp.cumsum(hits, axis=1) - 1) * hits, axis=-1)  # place in its expert
        kept = rank < C
        slot = jnp.where(kept, flat * C + rank, E * C)  # [B, Tk]; E C: the dropped ones' bin

        def fill(slot_row):  # which assignment each slot of one sequence holds (-1: none)
            return jnp.full((E * C + 1,), -1, jnp.int32).at[slot_row].set(
                jnp.arange(T * k, dtype=jnp.int32))[:E * C]

        holds = jax.vmap(fill)(slot)  # [B, E C]
        rows = jnp.take_along_axis(x, (jnp.maximum(holds, 0) // k)[..., None], axis=1)
        buffer = jnp.where((holds >= 0)[..., None], rows, 0).reshape(B, E, C, D)
        out = dispatch.token_layout(self.experts(dispatch.expert_layout(buffer)))
        out = jnp.concatenate([out.reshape(B, E * C, D), jnp.zeros((B, 1, D), out.dtype)], 1)
        y = jnp.take_along_axis(out, slot[..., None], axis=1).reshape(B, T, k, D)
        y = jnp.einsum("btkd,btk->btd", y, weights.astype(y.dtype))
        return constrain(y, ("batch", "seq", "embed")), jnp.sum(~kept, dtype=jnp.int32)

    def aux(self, logits, probs, chosen, dropped) -> dict[str, jax.Array]:
        """The layer's report: penalties as sums over positions (floats) and counts (ints)."""
        B, T, E = probs.shape
        counts = jnp.sum(jax.nn.one_hot(chosen, E, dtype=jnp.int32), axis=2)  # [B, T, E]
        share = jnp.sum(counts, axis=1) / T  # f: assignments per token, per sequence [B, E]
        balance = E * jnp.sum(share * jnp.mean(probs, axis=1), axis=-1)  # [B]
        aux = {"aux_loss": self.aux_coef * T * jnp.sum(balance),
               "expert_tokens": jnp.sum(counts, axis=(0, 1))}
        if self.z_coef:
            aux["z_loss"] = self.z_coef * jnp.sum(jax.nn.logsumexp(logits, axis=-1) ** 2)
        if dropped is not None:
            aux["dropped_tokens"] = dropped
        return aux
