"""The PyTorch peer: a GPT-2 of `gpt2-small`'s shape written the way nanoGPT writes one, and its
train step timed, so that the accelerator check can set minigpt's tokens/s beside it.

The model is what a nanoGPT user trains: pre-LayerNorm blocks with biases, fused query/key/value
projection, `scaled_dot_product_attention` (flash attention on a GPU), tanh-GELU, learned
positions, the output head tied to the token embedding, the vocabulary padded to 50,304 (as
minigpt pads 50,257 to a multiple of 128). The step is nanoGPT's: bfloat16 autocast, the
cross-entropy, backward, gradient clipping at 1.0, fused AdamW (weight decay 0.1 on matrices
and embeddings only, betas 0.9 / 0.95), the whole model through `torch.compile`. The same shape,
FLOPs and optimizer as minigpt's `gpt2-small` step, so tokens/s compare like for like.

    python bench/peer_nanogpt.py                   # gpt2-small at 16 x 1024 on the GPU
    python bench/peer_nanogpt.py --tiny --steps 3  # a tiny model on the CPU (a dry run)

torch is a bench-only dependency (the `hf` extra); minigpt never imports this file.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time

import torch
import torch.nn.functional as F  # noqa: N812 - PyTorch's own spelling
from torch import nn


@dataclasses.dataclass(frozen=True)
class PeerConfig:
    vocab_size: int = 50304  # GPT-2's 50,257 padded to a multiple of 128
    block_size: int = 1024
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768


GPT2_SMALL = PeerConfig()
TINY = PeerConfig(block_size=128, n_layer=2, n_head=8, n_embd=64)  # gpt2-tiny's shape


class SelfAttention(nn.Module):
    def __init__(self, cfg: PeerConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        # [B, T, 3C] -> three [B, nh, T, hs]
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
                   for t in self.qkv(x).split(C, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # flash on a GPU
        return self.proj(y.transpose(1, 2).contiguous().view(B, T, C))


class FeedForward(nn.Module):
    def __init__(self, cfg: PeerConfig):
        super().__init__()
        self.up = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.down = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x), approximate="tanh"))  # GPT-2's GELU


class Block(nn.Module):
    def __init__(self, cfg: PeerConfig):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(cfg.n_embd), nn.LayerNorm(cfg.n_embd)
        self.attn, self.mlp = SelfAttention(cfg), FeedForward(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: PeerConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.head.weight = self.wte.weight  # tied, as GPT-2
        self.apply(self._init)
        for name, p in self.named_parameters():  # GPT-2's scaled residual projections
            if name.endswith(("attn.proj.weight", "mlp.down.weight")):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def make_optimizer(model: GPT, device: str) -> torch.optim.Optimizer:
    """AdamW as nanoGPT configures it: decay on every tensor of two or more dimensions (matrices,
    embeddings), none on biases and norms; the fused kernel on a GPU."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=6e-4, betas=(0.9, 0.95), eps=1e-8,
                             fused=device == "cuda")


def time_train_step(cfg: PeerConfig = GPT2_SMALL, *, batch: int = 16, seq: int = 1024,
                    steps: int = 10, device: str | None = None,
                    backend: str | None = "inductor") -> dict:
    """Train steps of the peer on random tokens, timed after two warm-up steps (the first
    compiles): median step time, tokens/s, the compile time and the last loss. `backend` is
    torch.compile's ("inductor", its default and what is timed on a GPU; "aot_eager" traces the
    same graphs without generating kernels, which a CPU dry run can afford; None: eager)."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # as nanoGPT: float32 leftovers in TF32
        torch.backends.cudnn.allow_tf32 = True
    model = GPT(cfg).to(device)
    optimizer = make_optimizer(model, device)
    run = model if backend is None else torch.compile(model, backend=backend)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1), device=device)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def step() -> torch.Tensor:
        with torch.autocast(device_type=device, dtype=torch.bfloat16):
            loss = run(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    def synchronise() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    began = time.perf_counter()
    step()
    synchronise()
    compile_s = time.perf_counter() - began
    step()
    synchronise()
    times = []
    for _ in range(steps):
        began = time.perf_counter()
        loss = step()
        synchronise()
        times.append(time.perf_counter() - began)
    step_s = statistics.median(times)
    return {"peer": "nanoGPT-style PyTorch", "torch": torch.__version__, "device": device,
            "device_name": torch.cuda.get_device_name() if device == "cuda" else "cpu",
            "config": dataclasses.asdict(cfg), "batch": batch, "seq": seq,
            "compile_backend": backend, "compile_s": compile_s, "step_s": step_s,
            "tokens_per_s": batch * seq / step_s, "loss": loss.item(),
            "parameters": sum(p.numel() for p in model.parameters())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny model (a CPU dry run)")
    parser.add_argument("--batch", type=int)
    parser.add_argument("--seq", type=int)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--backend", default="inductor",
                        help="torch.compile's backend (aot_eager: quick, for a CPU; none: eager)")
    args = parser.parse_args(argv)
    cfg = TINY if args.tiny else GPT2_SMALL
    found = time_train_step(cfg, batch=args.batch or (2 if args.tiny else 16),
                            seq=args.seq or cfg.block_size, steps=args.steps,
                            backend=None if args.backend == "none" else args.backend)
    print(json.dumps(found, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
