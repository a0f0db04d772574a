"""What the output layer and loss hold at their peak, beside the activations the formula keeps for
backward (`accounting.outside_activation_terms`), and how many token chunks the planner gives a
layout whose whole logits do not fit (`remat.loss_chunks`, `loss.chunked_output_loss`).

Without chunks the loss's backward forms the logits' fp32 gradient [b, s, v/t] while the logits
themselves are still held (`loss._nll_sum_bwd`): a second copy at the step's peak. In chunks, one
chunk's logits and their gradient exist at a time, during the forward pass. (Both also make the
output layer's weight gradient, as the step's own gradient does; the planner's states hold it.)
"""

from __future__ import annotations

from meshlm.accounting import dtype_bytes
from meshlm.config import RunConfig

# the fewest tokens per device a planned chunk runs through the output layer: GEMMs of fewer rows
# leave a TPU's 128 x 128 systolic array or a GPU's tensor cores partly idle
MIN_CHUNK_TOKENS = 1024


def _tokens(cfg: RunConfig) -> float:
    """Tokens of one microbatch whose logits one device forms (all of its sequence shard's: SP gathers)."""
    t, par = cfg.train, cfg.parallel
    return t.global_batch / (par.batch_shards * t.microbatches) * t.seq_len / par.context


def _logits_bytes(cfg: RunConfig) -> float:
    """fp32 logits of one microbatch per device (the vocabulary split over `tensor`)."""
    return 4 * _tokens(cfg) * cfg.model.vocab_size / cfg.parallel.tensor


def transient_terms(cfg: RunConfig) -> dict[str, float]:
    """Bytes per device the loss holds beyond the kept activations at its peak (an unpipelined run):
    the logits' gradient beside the logits, or (in chunks) one chunk's logits and their gradient."""
    chunks = cfg.remat.loss_chunks
    if chunks == 1:
        return {"logits gradient": _logits_bytes(cfg)}
    return {"loss chunk (logits and gradient)": 2 * _logits_bytes(cfg) / chunks}


def planned_loss_chunks(cfg: RunConfig) -> int:
    """The chunks the planner gives a layout whose whole logits do not fit: the fewest that keep a
    chunk's fp32 logits within the bytes of the hidden state they come from (Liger-Kernel's rule of
    a chunk per V / d), but none under `MIN_CHUNK_TOKENS` tokens per device; a divisor of what each
    sequence shard holds (validation's rule). 1 when no such count exceeds 1."""
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
