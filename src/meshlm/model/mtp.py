"""Multi-token prediction (DeepSeek-V3 section 2.2; docs/deepseek.md).

`model.mtp_depth` = D sequential modules after the main model. Module k (1..D) at position i
combines its predecessor's hidden state h^{k-1}_i with the embedding of token t_{i+k}, as
`transformers`' `MtpLayer` and the released weights do: h' = W [RMSNorm_e(Emb(t_{i+k}));
RMSNorm_h(h^{k-1}_i)], then one transformer layer (an MoE layer in an MoE model), then its own
RMSNorm (`post_norm`, the checkpoint's `shared_head.norm`): h^k. h^0 is the main model's output
after its final norm, what its output layer reads (`transformers`' MtpModel and vLLM's drafter are
fed that). The shared output layer turns h^k into logits for t_{i+k+1}. Embedding and output layer
are the main model's (one copy each).

Loss: L_k = (1/T) sum over the positions with a token k+1 ahead of -log P(t_{i+k+1}) (the paper's
1/T: the main loss's token count, the positions past the end contributing nothing), and the
objective adds mtp_loss_coef / D x sum_k L_k. With a loss mask, module k trains position i where the
main loss trains position i + k; with packed documents, only where t_{i+k+1} is in i's document.

Context parallelism stores the sequence permuted (`Layout.seq_index`): the shifted tokens are made
in the original order and permuted back, int32 tokens crossing devices, never activations.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from meshlm.config import ModelConfig
from meshlm.model import layers
from meshlm.model.transformer import RESIDUAL, cast_layer, embed, llama_block, logits, output_loss
from meshlm.parallel import remat
from meshlm.parallel.rules import Layout, constrain

NAMES = ("enorm", "hnorm", "eh_proj", "post_norm")  # the module's own weights beside its layer's


def shifted(x_bt: jax.Array, k: int, layout: Layout | None, fill: int = 0) -> jax.Array:
    """x moved k positions to the left along the (original) sequence, `fill` past the end: position i
    holds x's position i + k, in the order the sequence is stored in."""
    if k == 0:
        return x_bt
    t = x_bt.shape[1]
    reordered = layout is not None and layout.reordered
    if reordered:
        index = layout.seq_index(t)
        x_bt = x_bt[:, jnp.asarray(index.argsort())]  # the original order
    x_bt = jnp.concatenate([x_bt[:, k:], jnp.full((x_bt.shape[0], k), fill, x_bt.dtype)], axis=1)
    return x_bt[:, jnp.asarray(index)] if reordered else x_bt


def targets(batch_targets, mask, segments, k: int, layout: Layout | None):
    """(module k's input tokens t_{i+k}, its targets t_{i+k+1}, its loss mask) for the batch's
    targets t_{i+1} [b, t], the main loss mask (None: all) and document ids (None: one document)."""
    inputs, goal = shifted(batch_targets, k - 1, layout), shifted(batch_targets, k, layout)
    ones = jnp.ones(batch_targets.shape, jnp.int32)
    valid = shifted(ones if mask is None else mask.astype(jnp.int32), k, layout)  # 0 past the end
    if segments is not None:
        valid = valid * (shifted(segments, k, layout, fill=-1) == segments)
    return inputs, goal, valid


def _modules(params: dict, x_btd, batch: dict, cfg: ModelConfig, layout, key, remat_policy: str):
    """Per module k = 1..D: (the output layer's weights with its norm, its output before that norm,
    targets t_{i+k+1}, loss mask, MoE RouterStats)."""
    segments = batch.get("segment_ids")
    norm = remat.wrap_elementwise(partial(layers.rms_norm, eps=cfg.norm_eps), remat_policy)

    def module(h, p, tokens, depth_key):
        e = embed(params, tokens, cfg, layout)
        both = jnp.concatenate([norm(e, p["enorm"]), norm(h, p["hnorm"])], axis=-1)
        h = constrain(layout, jnp.einsum("btc,cd->btd", both, p["eh_proj"]), RESIDUAL)
        block = {n: w for n, w in p.items() if n not in NAMES}
        return llama_block(h, block, depth_key, cfg, layout, remat_policy, segments)

    module = remat.wrap_layer(module, remat_policy)
    h = norm(x_btd, params["final_norm"])  # h^0: normed, as the output layer sees it
    for k in range(1, cfg.mtp_depth + 1):
        p = cast_layer(jax.tree.map(lambda a, k=k: a[k - 1], params["mtp"]), jnp.dtype(cfg.dtype))
        tokens, goal, valid = targets(batch["targets"], batch.get("mask"), segments, k, layout)
        depth_key = None if key is None else jax.random.fold_in(key, cfg.n_layers + 1 + k)
        h, stats = module(h, p, tokens, depth_key)  # before post_norm: the shared head normalises with it
        yield params | {"final_norm": p["post_norm"]}, h, goal, valid, stats
        h = norm(h, p["post_norm"])  # h^k, the next module's input


def objective(params: dict, x_btd, batch: dict, cfg: ModelConfig, layout, key, remat_policy: str, chunks: int = 1):
    """([D] loss sums of the modules, their MoE layers' RouterStats [D, ...] or None) from the main
    model's last layer output `x_btd` (before the final norm, which h^0 then gets); the output layer
    and loss in `chunks` token chunks (`remat.loss_chunks`)."""
    sums, stats = [], []
    for head, h, goal, valid, st in _modules(params, x_btd, batch, cfg, layout, key, remat_policy):
        sums.append(output_loss(head, h, goal, valid, cfg, layout, remat_policy, chunks)[0])
        stats.append(st)
    stacked = None if stats[0] is None else jax.tree.map(lambda *a: jnp.stack(a), *stats)
    return jnp.stack(sums), stacked


def weighted(sums: jax.Array, cfg: ModelConfig) -> jax.Array:
    """What the modules' loss sums [D] add to the objective: mtp_loss_coef / D x their sum (DeepSeek-V3's
    lambda / D; its 1/T is the objective's one division by the token count)."""
    return cfg.mtp_loss_coef / cfg.mtp_depth * jnp.sum(sums)


def module_logits(params: dict, x_btd, batch: dict, cfg: ModelConfig, layout=None) -> list:
    """Each module's logits [b, t, v] (position i predicting t_{i+k+1}), deterministic."""
    return [
        logits(head, h, cfg, layout) for head, h, *_ in _modules(params, x_btd, batch, cfg, layout, None, "elementwise")
    ]
