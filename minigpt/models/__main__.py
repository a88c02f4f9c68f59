"""`python -m minigpt.models`: the zoo, one line per named configuration: its parameters, and
those one token uses (`active`: of a mixture of experts' experts, k of E)."""

from flax import nnx

from minigpt.models import CONFIGS, build_model, count_params


def main() -> None:
    print(f"{'name':<14} {'arch':<8} {'params':>12} {'active':>12} {'layers':>6} {'width':>5} "
          f"{'heads':>7} {'context':>7} {'experts':>7}  tokenizer")
    for name, cfg in CONFIGS.items():
        model = nnx.eval_shape(lambda cfg=cfg: build_model(cfg, rngs=nnx.Rngs(0)))
        heads = f"{cfg.num_heads}/{cfg.kv_heads}" if cfg.kv_heads != cfg.num_heads else (
            str(cfg.num_heads))
        experts = f"{cfg.experts_per_token}/{cfg.num_experts}" if cfg.num_experts else "-"
        print(f"{name:<14} {cfg.arch:<8} {count_params(model, cfg):>12,} "
              f"{count_params(model, cfg, active=True):>12,} {cfg.num_layers:>6} "
              f"{cfg.embed_dim:>5} {heads:>7} {cfg.context_len:>7} {experts:>7}  {cfg.tokenizer}")


if __name__ == "__main__":
    main()
