"""Collectives the compiler cannot infer.

Most parallelism in minigpt is a preset's rules: the compiler partitions every operation from
the layouts of its operands. Where that cannot work, because an operation needs data that lives
on other devices in an order only the algorithm knows, the communication is written out here,
in one `jax.shard_map` region per operation, manual over one mesh axis and automatic over the
others. Model code calls these functions where the active rules ask for them and never names a
mesh axis; the axis comes from the rules (`minigpt.sharding`).

- `ring`: causal attention over a sequence split across devices (context parallelism): the
  ring and all-gather strategies and the dual-chunk order that balances their work; `blocks`,
  the online-softmax arithmetic of one pair of chunks both share.
- `experts`: a mixture of experts' dropless dispatch over the `expert` axis: each device sorts
  its tokens by expert, and the rows travel to their experts' devices and back by all-to-all.
- `local`: kernels the compiler cannot partition (Splash attention, a Pallas call), run on each
  device's rows and heads.
"""

from minigpt.parallel.local import NotLocal, attention_on_each_device
from minigpt.parallel.ring import (
    Ring,
    active_ring,
    causal_attention,
    check_length,
    dual_chunk_order,
    sequence_order,
)

__all__ = ["NotLocal", "Ring", "active_ring", "attention_on_each_device",
           "causal_attention", "check_length", "dual_chunk_order", "sequence_order"]
