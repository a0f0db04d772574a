"""What a train step holds at its peak beside the states and the activations kept for backward
(`accounting.activation_memory`), in an unpipelined run: the loss's transients, and with gradient
accumulation one microbatch's gradient beside the accumulator; and how many token chunks the planner
gives a layout whose whole logits do not fit (`remat.loss_chunks`, `loss.chunked_output_loss`).

Without chunks the loss's backward forms the logits' fp32 gradient [b, s, v/t] while the logits
themselves are still held (`loss._nll_sum_bwd`): a second copy at the step's peak. In chunks, one
chunk's logits and their gradient exist at a time, during the forward pass. (Both also make the
output layer's weight gradient, as the step's own gradient does.) With k > 1 microbatches
`step.gradients` adds each microbatch's fp32 gradient (sharded as the trainable weights) to the
accumulator, which the planner's states count: the microbatch's is a second copy. Under a layer-level
policy (`full`, `dots`, `offload`) each layer's backward reruns its forward, whose activations live
while it runs (`recomputed_layer_bytes`).
Measured against the compiled step's peak on one TPU v5e in BENCHMARKS-history.md ("The loss in
token chunks").
"""

from __future__ import annotations

from meshlm.accounting import activation_memory, dtype_bytes
from meshlm.config import RunConfig
from meshlm.parallel.remat import POLICIES

# the fewest tokens per device a planned chunk runs through the output layer, so that its GEMMs keep
# their size: on one TPU v5e, 16 chunks of 1024 tokens ran at 0.992x the whole loss's step time
# (BENCHMARKS-history.md, "The loss in token chunks"; on CPU, 256-token chunks at 1.002x)
MIN_CHUNK_TOKENS = 1024


def _tokens(cfg: RunConfig) -> float:
    """Tokens of one microbatch whose logits one device forms (all of its sequence shard's: SP gathers)."""
    t, par = cfg.train, cfg.parallel
    return t.global_batch / (par.batch_shards * t.microbatches) * t.seq_len / par.context


def _logits_bytes(cfg: RunConfig) -> float:
    """fp32 logits of one microbatch per device (the vocabulary split over `tensor`)."""
    return 4 * _tokens(cfg) * cfg.model.vocab_size / cfg.parallel.tensor


def transient_terms(cfg: RunConfig, trainable: float = 0.0) -> dict[str, float]:
    """Bytes per device an unpipelined step holds beyond its states and kept activations at its peak:
    the logits' gradient beside the logits, or (in chunks) one chunk's logits and their gradient; with
    k > 1 microbatches, the microbatch's fp32 gradient of the `trainable` parameters a device holds."""
    chunks = cfg.remat.loss_chunks
    out = {"logits gradient": _logits_bytes(cfg)} if chunks == 1 else {}
    if chunks > 1:
        out["loss chunk (logits and gradient)"] = 2 * _logits_bytes(cfg) / chunks
    if cfg.train.microbatches > 1:
        out["microbatch gradient"] = 4 * trainable
    if POLICIES[cfg.remat.policy].layer is not None:
        out["recomputed layer"] = recomputed_layer_bytes(cfg)
    return out


# what a layer-level policy stores, by the name of the `elementwise` term for the same tensor
_STORED_AS = {"layer_input": "norm1_input", "fc1_out": "gelu_input"}


def recomputed_layer_bytes(cfg: RunConfig) -> float:
    """A layer-level policy (`full`, `dots`, `offload`) reruns each layer's forward in its backward pass:
    while that layer's backward runs, the activations `elementwise` would keep for it exist, less those
    the policy stored (its layer input; `dots`' matmul outputs; offload's are back from the host by
    then, and its device terms are full's). The larger kind of layer, one microbatch, per device."""
    stored, rerun = (activation_memory(cfg, policy=p) for p in (cfg.remat.policy, "elementwise"))

    def new(kept: dict, all_of_them: dict) -> float:
        names = {_STORED_AS.get(n, n) for n in kept}
        return sum(v for n, v in all_of_them.items() if n not in names)

    return max(new(stored[k], rerun[k]) for k in ("per_layer", "dense_per_layer"))  # MoE's, a dense one's


def planned_loss_chunks(cfg: RunConfig) -> int:
    """The chunks the planner gives a layout whose whole logits do not fit: the fewest that keep a
    chunk's fp32 logits within the bytes of the hidden state they come from (about 4V / (t e d) chunks
    for `tensor` = t and a compute dtype of e bytes), but none under `MIN_CHUNK_TOKENS`
    tokens per device; a divisor of what each sequence shard holds (validation's rule). 1 when no
    such count exceeds 1."""
    t, par, m = cfg.train, cfg.parallel, cfg.model
    per_shard = t.seq_len // (par.context * (par.tensor if par.sequence_parallel else 1))
    hidden = dtype_bytes(m.dtype) * m.d_model * _tokens(cfg)
    best = 1
    for n in (n for n in range(2, per_shard + 1) if per_shard % n == 0):
        if _tokens(cfg) / n < MIN_CHUNK_TOKENS:
            break
        best = n
        if _logits_bytes(cfg) / n <= hidden:
            break
    return best
