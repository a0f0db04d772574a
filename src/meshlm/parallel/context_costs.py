"""Costs of context parallelism, as arithmetic on the config (no JAX): which (query, key) block
pairs each rank's kernel executes, and the bytes each device receives (`accounting` re-exports both)."""

from __future__ import annotations

from meshlm.config import RunConfig


def context_block_pairs(seq_len: int, context: int, load_balance: bool, block: int) -> list[int]:
    """(query block, key block) pairs each context rank's kernel executes: those with some key at
    or before some query in the original order - the kernel's skip rule
    (`blockwise.blocks_visible`), on the positions the loader's reordering gives each rank.
    Load-balanced, every rank executes the same number."""
    import numpy as np

    from meshlm.parallel.rules import context_order, sequence_index

    blocks = sequence_index(seq_len, context_order(context, load_balance)).reshape(context, -1, block)
    key_first = np.sort(blocks.min(-1).reshape(-1))  # every rank's key blocks (ring and all-gather see all)
    last = blocks.max(-1)  # [rank, query block]
    # pairs with key.min() <= query.max(): `blocks_visible`, counted by binary search
    return [int(np.searchsorted(key_first, last[r], side="right").sum()) for r in range(context)]


def context_comm_bytes(cfg: RunConfig) -> dict[str, float]:
    """Bytes each device receives per step under context parallelism, by direction. Per layer and
    microbatch, with KV = one rank's K and V in the compute dtype and dKV its fp32 gradients:

    - ring: forward c-1 hops of KV; backward c-1 hops of KV and c of dKV (the gradients ride home);
    - all_gather: forward gathers (c-1) x KV; backward gathers again and reduce-scatters dKV;
    - all_to_all: forward (c-1)/c of one rank's Q, K and V (one all-to-all) and of the kernel's
      output (the other); backward their transposes, the same bytes (gradients in the compute dtype).
      Per device this falls as c grows; the ring's and all_gather's grow towards the whole K/V.

    Policies that recompute the attention forward in backward (full, dots, offload) run the
    forward exchange twice. Positions and document ids (int32 per token) are not counted."""
    from meshlm.accounting import dtype_bytes

    m, par, t = cfg.model, cfg.parallel, cfg.train
    c = par.context
    if c == 1:
        return {}
    b = t.global_batch // t.microbatches // par.batch_shards
    tokens = t.seq_len // c * b * m.dim_head / par.tensor  # one rank's tokens x head_dim, per head
    local = tokens * m.kv_heads
    kv, dkv = 2 * dtype_bytes(m.dtype) * local, 2 * 4 * local
    forwards = 2 if cfg.remat.policy in ("full", "dots", "offload") else 1
    if par.context_strategy == "all_to_all":
        qkvo = dtype_bytes(m.dtype) * tokens * (2 * m.n_heads + 2 * m.kv_heads)
        per_layer_fwd = per_layer_bwd = (c - 1) / c * qkvo
    else:
        per_layer_fwd = (c - 1) * kv
        per_layer_bwd = (c - 1) * kv + (c if par.context_strategy == "ring" else c - 1) * dkv
    n = (m.n_layers + m.mtp_depth) * t.microbatches  # the MTP modules' layers attend too
    return {"forward": n * forwards * per_layer_fwd, "backward": n * per_layer_bwd}
