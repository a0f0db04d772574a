"""Parameter counts and FLOPs, as pure arithmetic on the config (no JAX).

FLOPs count GEMMs only (multiply-add = 2 FLOPs), as P2 Appendix A and Narayanan et al. do.
Causal attention is *not* halved: the paper counts QK^T and attention-over-V as full s x s
matmuls, and so do we. With MHA, d_ff = 4h and a GeLU MLP this is exactly P2's Eq. 7:

    model FLOPs / step = 72 B L s h^2 (1 + s/(6h) + v/(12 h L))

and it generalises the way Megatron-LM's `num_floating_point_operations` does: GQA shrinks the K/V
projections, SwiGLU has three d x d_ff matrices instead of two.
"""

from __future__ import annotations

import dataclasses

from meshlm.config import ModelConfig, RunConfig
from meshlm.model import mla_costs
from meshlm.model.lora import lora_param_count
from meshlm.model.moe_costs import expert_slot_flops, moe_terms
from meshlm.model.tensor_costs import replicated_flops_per_token, rerun_flops_per_token
from meshlm.parallel.context_costs import context_block_pairs, context_comm_bytes  # noqa: F401 (their home here)
from meshlm.parallel.schedules import SPLIT, chunk_slots, pipeline_unit


def param_count(cfg: ModelConfig) -> int:
    """Exact number of parameters `model.params.param_specs` creates (tested against it)."""
    d, n, k, h, f, v, L = (
        cfg.d_model,
        cfg.n_heads,
        cfg.kv_heads,
        cfg.dim_head,
        cfg.ffn,
        cfg.vocab_size,
        cfg.n_layers,
    )
    attn = mla_costs.attention_params(cfg) if cfg.mla else d * n * h + 2 * d * k * h + n * h * d
    if cfg.family == "gpt":
        per_layer = attn + (n * h + 2 * k * h + d) + 2 * d * f + f + d + 4 * d  # + biases, 2 LNs
        return v * d + cfg.max_seq_len * d + L * per_layer + 2 * d + lora_param_count(cfg)
    per_layer = attn + 2 * d + (n * h + 2 * k * h if cfg.qkv_bias else 0) + (2 * h if cfg.qk_norm else 0)
    kinds = layer_kinds(cfg)
    layers = L * per_layer + sum(count * _mlp_params(kind, kind.n_experts) for kind, count in kinds)
    # MTP modules: a layer of the first kind (MoE in an MoE model), 3 norms, the [2d, d] projection
    mtp = cfg.mtp_depth * (per_layer + _mlp_params(kinds[0][0], cfg.n_experts) + 3 * d + 2 * d * d)
    return (1 if cfg.tied_embeddings else 2) * v * d + layers + mtp + d + lora_param_count(cfg)


def attention_layers(m: ModelConfig) -> int:
    """Layers with an attention core: the model's and the MTP modules'."""
    return m.n_layers + m.mtp_depth


def layer_kinds(cfg: ModelConfig) -> list[tuple[ModelConfig, int]]:
    """(the model as one kind of layer sees it, how many layers of that kind): one kind, or an MoE
    model's MoE layers and its dense ones (`model.dense_layer_ids`), seen as a dense llama of d_ff."""
    if not cfg.dense_layer_ids:
        return [(cfg, cfg.n_layers)]
    moe = dataclasses.replace(cfg, first_k_dense=0, moe_layer_step=1, dense_layers=())
    dense = dataclasses.replace(moe, n_experts=0)
    return [(moe, len(cfg.moe_layer_ids)), (dense, len(cfg.dense_layer_ids))]


def unit_kinds(cfg: ModelConfig) -> list[int]:
    """Each layer of a pipeline unit (`schedules.pipeline_unit`) as its index into `layer_kinds`."""
    one = len(layer_kinds(cfg)) == 1
    return [0 if moe or one else 1 for moe in pipeline_unit(cfg).kinds]


def with_layers(cfg: ModelConfig, n: int, units: bool = False) -> ModelConfig:
    """The model cut to n layers (>= 2 when it has dense layers among MoE ones: then its first
    layer's kind, then the other kind, so that both stay; `units`, for a pipeline: its unit of
    several layers, `schedules.pipeline_unit`, repeated after at most one dense first layer):
    `meshlm check` and the planner's compile. With `units`, n must be that layer and whole units."""
    if not cfg.dense_layer_ids:
        return dataclasses.replace(cfg, n_layers=n)
    unit = pipeline_unit(cfg)
    if units and unit and len(unit.kinds) > 1:
        k, u = min(unit.prefix, 1), len(unit.kinds)
        dense = tuple(i for i in range(k, n) if not unit.kinds[(i - k) % u])
        return dataclasses.replace(cfg, n_layers=n, first_k_dense=k, moe_layer_step=1, dense_layers=dense)
    first_dense = 0 in cfg.dense_layer_ids
    dense = {"first_k_dense": 1} if first_dense else {"dense_layers": tuple(range(1, n))}
    return dataclasses.replace(cfg, n_layers=n, moe_layer_step=1, **({"first_k_dense": 0, "dense_layers": ()} | dense))


def _mlp_params(cfg: ModelConfig, experts: int) -> int:
    """A llama layer's MLP parameters with `experts` routed experts counted (MoE: router, experts,
    shared experts and their gate; dense: the SwiGLU)."""
    d, e = cfg.d_model, cfg.n_experts
    if not cfg.moe:
        return 3 * d * cfg.ffn
    return e * (d + cfg.router_bias) + 3 * d * (experts * cfg.expert_ffn + cfg.shared_ffn) + d * cfg.shared_expert_gate


def active_param_count(cfg: ModelConfig) -> int:
    """Parameters one token uses: all of a dense model's; an MoE model's with k of its E routed
    experts (router, shared experts, attention and embeddings counted whole)."""
    if not cfg.moe:
        return param_count(cfg)
    idle = _mlp_params(cfg, cfg.n_experts) - _mlp_params(cfg, cfg.experts_per_token)
    return param_count(cfg) - len(cfg.moe_stat_layer_ids) * idle


def layer_forward_flops_per_token(cfg: ModelConfig, seq_len: int) -> dict[str, int]:
    """Forward GEMM FLOPs of one layer for one token, by term. MoE (Megatron's form): "mlp" is the
    k routed experts' SwiGLUs plus the shared experts' (and their gate), "router" the router's."""
    d, n, k, h, f = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.dim_head, cfg.ffn
    n_mlp_mats = 2 if cfg.family == "gpt" else 3
    v = cfg.value_dim  # MLA: v_head_dim
    terms = {
        "qkv": mla_costs.projection_flops(cfg) if cfg.mla else 2 * d * (n + 2 * k) * h,
        "attn_scores": 2 * seq_len * n * h,  # QK^T, not halved for causality
        "attn_values": 2 * seq_len * n * v,  # probs @ V
        "attn_out": 2 * n * v * d,
        "mlp": 2 * n_mlp_mats * d * f,
    }
    if cfg.moe:
        routed = cfg.experts_per_token * 3 * d * cfg.expert_ffn
        terms |= {"mlp": 2 * (routed + 3 * d * cfg.shared_ffn + d * cfg.shared_expert_gate)}
        terms["router"] = 2 * d * cfg.n_experts
    return terms


def model_flops_per_step(cfg: RunConfig) -> int:
    """P2 Eq. 7 (generalised): forward + backward (= 3x forward) GEMM FLOPs of one optimizer step,
    with B = sequences per step (global batch), as Table 5's MFU requires. It counts causal
    attention as the whole s x s; `causal_flops_per_step` does not. LoRA: the frozen weights' GEMMs
    run 2x (forward, input gradient; no weight gradient), the attention core's and the adapters' 3x."""
    m, t = cfg.model, cfg.train
    terms = layer_forward_flops_per_token(m, t.seq_len)
    kinds = layer_kinds(m)
    layers = sum(n * sum(layer_forward_flops_per_token(kind, t.seq_len).values()) for kind, n in kinds)
    per_token = layers + 2 * m.d_model * m.vocab_size  # + the logits
    # MTP: per module a layer of the first kind, the [2d, d] projection and the shared output layer
    mtp_layer = sum(layer_forward_flops_per_token(kinds[0][0], t.seq_len).values())
    per_token += m.mtp_depth * (mtp_layer + 2 * 2 * m.d_model**2 + 2 * m.d_model * m.vocab_size)
    if not m.lora_rank:
        return 3 * t.global_batch * t.seq_len * per_token
    core = m.n_layers * (terms["attn_scores"] + terms["attn_values"])
    adapters = 2 * lora_param_count(m)  # forward FLOPs per token: 2 r (in + out) per target and layer
    return t.global_batch * t.seq_len * (2 * (per_token - core) + 3 * core + 3 * adapters)


def causal_flops_per_step(cfg: RunConfig) -> int:
    """The model FLOPs meshlm's MFU divides by: P2 Eq. 7 without the masked half of causal
    attention - QK^T and probs @ V over the s(s+1)/2 (query, key) pairs the mask leaves, not s^2 (the
    convention of MaxText and the FlashAttention papers). Kernels that skip masked blocks then never
    show an MFU above 100%; Eq. 7's figure stays `model_flops_per_step` (P2 Table 5)."""
    m, t = cfg.model, cfg.train
    terms = layer_forward_flops_per_token(m, t.seq_len)
    attention = 3 * t.global_batch * t.seq_len * attention_layers(m) * (terms["attn_scores"] + terms["attn_values"])
    return model_flops_per_step(cfg) - attention * (t.seq_len - 1) // (2 * t.seq_len)


def recompute_flops_per_step(cfg: RunConfig) -> int:
    """Forward GEMM FLOPs the remat policy re-executes in the backward pass - what really runs,
    checked against the lowered program (tests/test_flops.py). JAX recomputes only what backward
    needs, so this is less than P2 assumes:

    - selective: QK^T once more (2*B*s^2*h per layer, over the query chunks' score blocks). P2
      counts QK^T *and* attention over V (4*B*s^2*h); attention-over-V's output is not needed by
      backward, so it is not recomputed.
    - full: the layer's forward GEMMs except the last MLP projection, whose output only feeds the
      residual add and is needed by nothing in backward.
    - dots / offload: the weight-GEMM outputs are kept, but not the attention core's batched
      matmuls (QK^T and attention over V, or the O(s) kernel's forward): those run again, as
      backward needs the core's output; elementwise: none.

    MoE: the routed experts' GEMMs run over the rows `expert_slot_flops` counts (capacity slots, or
    the grouped kernel's tiles), and `full` recomputes all of them, down projection included (the
    combine's weight gradient reads its output); `dots` and `offload` recompute them too (batched or
    looped matmuls, like the attention core). Plus LoRA's reruns (its dropout's redrawn x A among
    them) and those of what every tensor rank runs (`tensor_costs.rerun_flops_per_token`).
    """
    m, t, par = cfg.model, cfg.train, cfg.parallel
    tokens_layers = t.global_batch * t.seq_len * attention_layers(m)
    policy = cfg.remat.policy
    frac = attention_executed_fraction(m, t.seq_len, context_chunk(cfg))
    scores, values = _core_terms(cfg)
    counted, executed = expert_slot_flops(cfg)
    again = t.global_batch * t.seq_len * rerun_flops_per_token(m, policy, par.tensor, par.sequence_parallel)
    if policy == "full":
        tokens = t.global_batch * t.seq_len  # (tokens x layers) x per token, as one kind always multiplied
        core, kinds = frac * (scores + values), layer_kinds(m)
        layers = sum(tokens * n * _full_recompute_per_token(kind, t.seq_len, core) for kind, n in kinds)
        # each MTP module is checkpointed as a layer is: its layer and its [2d, d] projection run again
        layers += tokens * m.mtp_depth * (_full_recompute_per_token(kinds[0][0], t.seq_len, core) + 4 * m.d_model**2)
        return round(layers) + executed - counted + again
    if policy in ("dots", "offload"):
        return round(tokens_layers * frac * (scores + values)) + executed + again
    if policy == "selective" and m.attention == "explicit":  # the O(s) kernels are never checkpointed
        return round(tokens_layers * frac * scores) + again
    return again


def _core_terms(cfg: RunConfig) -> tuple[int, int]:
    """One pass of QK^T and of probs @ V per token and layer, over the whole s x s, as the kernel runs
    them: `layer_forward_flops_per_token`'s terms, but MLA's heads padded to one size where its kernel
    needs that (`mla_costs.padded`)."""
    m, s = cfg.model, cfg.train.seq_len
    qk, v = mla_costs.core_sizes(m, m.attention == "explicit" and cfg.parallel.context == 1)
    return 2 * s * m.n_heads * qk, 2 * s * m.n_heads * v


def _full_recompute_per_token(m: ModelConfig, seq_len: int, core: float) -> float:
    """One layer's forward GEMMs per token that `full` runs again: all but the last MLP projection
    (MoE: but the shared experts' down projection, when no gate multiplies its output), with the
    attention core as its kernel executes it (`core` FLOPs per token)."""
    terms = layer_forward_flops_per_token(m, seq_len)
    attn = terms["attn_scores"] + terms["attn_values"]
    last_mlp = terms["mlp"] // (2 if m.family == "gpt" else 3)
    if m.moe:
        last_mlp = 0 if m.shared_expert_gate else 2 * m.d_model * m.shared_ffn
    return sum(terms.values()) - last_mlp - attn + core


def attention_core_flops(cfg: RunConfig) -> int:
    """FLOPs the attention core (QK^T, attention over V, their backward) executes per step,
    recomputation included: 6 matmul passes explicit, 7 for the O(s) kernels, each over the executed
    score blocks, plus whatever of it the policy re-runs (`recompute_flops_per_step`)."""
    m, t = cfg.model, cfg.train
    tokens_layers = t.global_batch * t.seq_len * attention_layers(m)
    scores, values = (tokens_layers * x for x in _core_terms(cfg))
    frac = attention_executed_fraction(m, t.seq_len, context_chunk(cfg))
    kernel = ((3 if m.attention == "explicit" else 4) * scores + 3 * values) * frac
    policy = cfg.remat.policy
    rerun = (scores + values) * frac if policy in ("full", "dots", "offload") else 0.0
    if policy == "selective" and m.attention == "explicit":
        rerun = scores * frac
    return round(kernel + rerun)


def attention_forward_flops(cfg: RunConfig) -> int:
    """FLOPs of the attention core's forward per step (QK^T and attention over V over the executed
    score blocks): what a kernel re-run in backward adds."""
    m, t = cfg.model, cfg.train
    core = sum(_core_terms(cfg)) * t.global_batch * t.seq_len * attention_layers(m)
    return round(core * attention_executed_fraction(m, t.seq_len, context_chunk(cfg)))


def attention_block(m: ModelConfig, seq_len: int, context_chunk: int | None = None) -> int:
    """The block the O(s) kernels run: `model.attention_block`, at most the sequence (and under
    context parallelism at most one context chunk, `parallel.context.kernel_block`)."""
    return min(m.attention_block, seq_len, context_chunk or seq_len)


def context_chunk(cfg: RunConfig) -> int | None:
    """Tokens per context chunk (seq_len / (2c) load-balanced, / c otherwise) that bound the kernel's
    block; None without CP, and under `all_to_all`, whose kernel runs on whole sequences."""
    par = cfg.parallel
    split = par.context > 1 and par.context_strategy != "all_to_all"
    return cfg.train.seq_len // par.context_chunks if split else None


MAX_QUERY_CHUNKS = 16  # the chunks are unrolled: beyond this, longer chunks keep the program small


def query_chunks(t: int, chunk: int) -> tuple[tuple[int, int], ...]:
    """(start, end) of the query chunks explicit attention computes one after another: `chunk`
    rows each (the last one shorter if `chunk` does not divide t), or t / MAX_QUERY_CHUNKS rows
    (rounded up) if that is more; one chunk of all t rows when `chunk` is 0 or at least t (P2's
    whole s x s score matrix)."""
    if chunk <= 0 or chunk >= t:
        return ((0, t),)
    chunk = max(chunk, -(-t // MAX_QUERY_CHUNKS))
    return tuple((a, min(a + chunk, t)) for a in range(0, t, chunk))


def chunked_score_elements(t: int, chunk: int) -> int:
    """Score elements per row of the batch and head that chunked explicit attention computes and
    stores: each chunk's rows against the keys up to its last query, the sum of rows x keys; t*t for
    one chunk, t(t + chunk)/2 when `chunk` divides t (and no cap applies)."""
    return sum((e - a) * e for a, e in query_chunks(t, chunk))


def attention_executed_fraction(m: ModelConfig, seq_len: int, context_chunk: int | None = None) -> float:
    """Of the s x s score (and probs @ V) FLOPs the model counts, the share a kernel executes: for
    explicit attention the score blocks of its query chunks (`chunked_score_elements` / s^2; 1 with
    `attention_chunk` = 0); for blockwise (and, approximately, fused: its kernels skip masked blocks
    of their own size) the query/key block pairs on or below the diagonal, nb(nb+1)/2 blocks of
    B x B with nb = ceil(s/B).
    Context parallelism skips the same pairs, spread over its ranks (`context_block_pairs`)."""
    if m.attention == "explicit":
        return chunked_score_elements(seq_len, m.attention_chunk) / seq_len**2
    block = attention_block(m, seq_len, context_chunk)
    nb = -(-seq_len // block)
    return nb * (nb + 1) / 2 * block * block / seq_len**2


def _attention_kernel_flops_adjustment(cfg: RunConfig) -> int:
    """Executed minus counted attention FLOPs of the attention core, over the score blocks
    `attention_executed_fraction` says: explicit attention runs the 6 matmuls the model counts
    (QK^T and P @ V forward; dP, dV, dK, dQ backward) on its chunks' blocks; the O(s) kernels also
    recompute QK^T in backward (7). MLA's padded heads (`_core_terms`) run at their padded size."""
    m, t = cfg.model, cfg.train
    terms = layer_forward_flops_per_token(m, t.seq_len)
    scores, values = _core_terms(cfg)
    executed = ((3 if m.attention == "explicit" else 4) * scores + 3 * values) * attention_executed_fraction(
        m, t.seq_len, context_chunk(cfg)
    )
    tokens_layers = t.global_batch * t.seq_len * attention_layers(m)
    return round(tokens_layers * (executed - 3 * (terms["attn_scores"] + terms["attn_values"])))


def forward_flops_per_step(cfg: RunConfig) -> int:
    """GEMM FLOPs the forward pass executes (once; recomputation is backward work): a third of the
    model FLOPs, with attention over the score blocks the kernel runs instead of the full s x s."""
    m, t = cfg.model, cfg.train
    terms = layer_forward_flops_per_token(m, t.seq_len)
    executed = sum(_core_terms(cfg)) * attention_executed_fraction(m, t.seq_len, context_chunk(cfg))
    tokens_layers = t.global_batch * t.seq_len * attention_layers(m)
    return model_flops_per_step(cfg) // 3 + round(
        tokens_layers * (executed - terms["attn_scores"] - terms["attn_values"])
    )


def hardware_flops_per_step(cfg: RunConfig) -> int:
    """GEMM FLOPs actually executed per step: model FLOPs plus the policy's recomputation, with what
    the attention kernel executes (chunked explicit, blockwise, fused) instead of the counted s x s
    terms, and (MoE) the routed experts over their capacity buffers or grouped tiles, not k per token.
    HFU uses this. (For P2's own HFU numbers, which assume more recomputation, see
    `p2_eq8_flops`.)"""
    counted, executed = expert_slot_flops(cfg)  # MoE: every capacity slot or tile row runs, filled or not
    extra = (2 if cfg.model.lora_rank else 3) * (executed - counted)  # LoRA: the experts are frozen
    m, p, t = cfg.model, cfg.parallel, cfg.train  # what every tensor rank runs (`tensor_costs`)
    extra += t.global_batch * t.seq_len * replicated_flops_per_token(m, p.tensor, p.sequence_parallel)
    return model_flops_per_step(cfg) + recompute_flops_per_step(cfg) + _attention_kernel_flops_adjustment(cfg) + extra


def p2_eq8_flops(batch: int, n_layers: int, seq_len: int, d_model: int, vocab: int) -> float:
    """P2's Eq. 8 as printed, 72BLsh^2(1 + s/(3h) + v/(12hL)): the hardware FLOPs behind its
    Table 5 HFU. It adds 12*B*s^2*h per layer over Eq. 7, three times the 4*B*s^2*h forward of QK^T
    and attention over V that its text describes; we reproduce the paper with it and count what
    runs with `hardware_flops_per_step`."""
    B, L, s, h, v = batch, n_layers, seq_len, d_model, vocab
    return 72 * B * L * s * h**2 * (1 + s / (3 * h) + v / (12 * h * L))


def utilisation(flops_per_step: float, step_time_s: float, peak_flops_per_s: float) -> float:
    """MFU (with model FLOPs) or HFU (with hardware FLOPs): achieved / peak FLOP/s."""
    if step_time_s <= 0 or peak_flops_per_s <= 0:
        return 0.0
    return flops_per_step / step_time_s / peak_flops_per_s


# ----------------------------------------------------------------------------- activation memory
#
# P2 section 4: bytes of forward tensors kept for the backward pass, per device. Each term is named
# after the tensor it is, so a report can say which part is large. With the `gpt` family in P2's
# setting (bf16, dropout on, explicit softmax over the whole s x s: attention_chunk=0) the per-layer
# sum is exactly Table 2 (query chunks shrink its 5as/h term to the blocks they run):
#   elementwise: sbh(34 + 5as/h)     TP: sbh(10 + 24/t + 5as/(ht))      TP+SP: sbh(34 + 5as/h)/t
#   TP+selective: sbh(10 + 24/t)     TP+SP+selective: 34sbh/t           full: 2sbh (2sbh/t with SP)
# and it extends term by term to GQA (smaller K and V), SwiGLU (gate, up and down-projection input
# instead of GeLU input and FC2 input), no dropout (no masks, probabilities kept once) and fused
# attention (no score matrix; an fp32 log-sum-exp per row instead, as flash attention keeps).

MASK_BYTES = 1  # a bool keep-mask per element (P2: 1 byte)


def dtype_bytes(dtype: str) -> int:
    return {"bfloat16": 2, "float32": 4}[dtype]


def layer_activation_terms(
    m: ModelConfig,
    seq_len: int,
    micro_batch: int,
    tensor: int = 1,
    sequence_parallel: bool = False,
    policy: str = "elementwise",
    ulysses: int = 1,
    expert: int = 1,
    context: bool = False,
) -> dict[str, float]:
    """Bytes per device of one layer's stored activations, by tensor. MLA (`context`: the sequence
    is split over `context`, whose kernels take MLA's heads padded): its q, k, v at the sizes the
    kernel runs, and its latents (`mla_costs.latent_terms`) but under SP, whose region keeps only its
    input. `micro_batch` is per device (P2's b); `tensor` is t; the LayerNorm/dropout/residual
    regions are split by t only under SP. `ulysses` (context size under `all_to_all`, `seq_len`
    then being per rank): the attention core holds the whole sequence (x ulysses) of 1/ulysses of
    the heads - the same bytes for Q, K, V and the output, ulysses times more per head of score
    matrix, for ulysses times fewer heads - and an O(s) kernel's output is kept twice (its own
    backward's copy, and the projection's input)."""
    e, s, b, t = dtype_bytes(m.dtype), seq_len, micro_batch, tensor
    d, n, k, hd, f = m.d_model, m.n_heads, m.kv_heads, m.dim_head, m.ffn
    r = t if sequence_parallel else 1  # split of the sequence-parallel regions
    dropout = m.dropout > 0
    if policy in ("full", "offload", "dots"):
        terms = {"layer_input": e * s * b * d / r}
        if policy == "dots":
            terms |= _dot_output_terms(m, s, b, t, r)
        return terms  # offload: the dot outputs live in host memory (see activation_memory)

    terms: dict[str, float] = {
        "norm1_input": e * s * b * d / r,
        "qkv_input": e * s * b * d / r,  # LayerNorm output (under SP: the local shard, re-gathered)
        "q": e * s * b * n * hd / t,
        "k": e * s * b * k * hd / t,
        "v": e * s * b * k * hd / t,
    }
    pad = mla_costs.padded(m, m.attention == "explicit" and not context)
    if m.mla:
        qk, vd = mla_costs.core_sizes(m, not pad)
        terms |= {"q": e * s * b * n * qk / t, "k": e * s * b * n * qk / t, "v": e * s * b * n * vd / t}
        if not (sequence_parallel and t > 1):
            terms |= mla_costs.latent_terms(m, e, s, b)
        if pad:  # the kernel keeps its padded output, the projection the slice of it
            terms["attn_out_padded"] = e * s * b * n * pad / t
    if m.attention != "explicit":  # flash/blockwise: Q, K, V, the output (below) and an fp32 lse per row
        terms["attn_logsumexp"] = 4 * s * b * n / t
        if ulysses > 1:  # its output in the heads layout too: the all-to-all's result feeds the projection
            terms["attn_out_heads"] = e * s * b * n * hd / t
    elif policy != "selective":  # selective recomputes these from Q, K, V
        scores = chunked_score_elements(s * ulysses, m.attention_chunk)  # s * s unchunked (P2)
        heads = n / (t * ulysses)
        terms["attn_probs"] = e * heads * scores * b
        if dropout:
            terms["attn_dropout_mask"] = MASK_BYTES * heads * scores * b
            terms["attn_probs_dropped"] = e * heads * scores * b
    terms["out_proj_input"] = e * s * b * n * m.value_dim / t
    if dropout:
        terms["attn_out_dropout_mask"] = MASK_BYTES * s * b * d / r
    terms["norm2_input"] = e * s * b * d / r
    terms["mlp_input"] = e * s * b * d / r
    if m.family == "gpt":
        terms["gelu_input"] = e * s * b * f / t
        terms["fc2_input"] = e * s * b * f / t
    elif m.moe:
        terms |= moe_terms(m, s, b, t, sequence_parallel, expert)
    else:
        terms["gate"] = e * s * b * f / t
        terms["up"] = e * s * b * f / t
        terms["down_input"] = e * s * b * f / t
    if dropout:
        terms["mlp_dropout_mask"] = MASK_BYTES * s * b * d / r
    return terms


def _dot_output_terms(m: ModelConfig, s: int, b: int, t: int, r: int) -> dict[str, float]:
    """The `dots` policy keeps the weight-matmul outputs the backward pass needs: Q, K, V, the
    attention-out projection (to rebuild the MLP's input) and the MLP's first matmul(s). The MLP-out
    projection's output is needed by nothing and is not kept. Under SP the attention-out product is
    kept as the partial sums before the reduce-scatter, full-sequence (r = 1 for that term)."""
    e, d, n, k, hd, f = dtype_bytes(m.dtype), m.d_model, m.n_heads, m.kv_heads, m.dim_head, m.ffn
    terms = {"q": e * s * b * n * hd / t, "k": e * s * b * k * hd / t, "v": e * s * b * k * hd / t}
    if m.mla:  # the up-projections' outputs (q, the keys' no-RoPE part, v) and the down-projections'
        terms |= {"k": e * s * b * n * m.qk_nope_head_dim / t, "v": e * s * b * n * m.value_dim / t}
        terms["latents"] = e * s * b * (m.q_lora_rank + m.kv_lora_rank + m.qk_rope_head_dim)  # SP too
    terms["attn_out"] = e * s * b * d
    if m.family == "gpt":
        terms["fc1_out"] = e * s * b * f / t
    elif m.moe:  # the experts' matmuls are batched (over experts): recomputed, like the attention core
        terms["router_logits"] = 4 * s * b * m.n_experts
        if m.shared_ffn:
            terms |= {"shared_gate": e * s * b * m.shared_ffn / t, "shared_up": e * s * b * m.shared_ffn / t}
        if m.shared_expert_gate:  # its output, for the gate's gradient, and the gate's logit
            terms["shared_gated_output"] = e * s * b * d + 4 * s * b
    else:
        terms |= {"gate": e * s * b * f / t, "up": e * s * b * f / t}
    return terms


def outside_activation_terms(
    m: ModelConfig, s: int, b: int, t: int = 1, sp: bool = False, pipeline: int = 1, loss_chunks: int = 1
) -> dict[str, float]:
    """P2 section 4.3: embedding dropout (x p microbatches in flight on the first pipeline stage),
    and - only when p = 1 - final norm input, output-layer input and fp32 logits. Token ids,
    targets (int32) and the cross-entropy's fp32 log-sum-exp per token are listed too: P2 ignores
    them as small; we keep every byte we store. With `loss_chunks` > 1 (`loss.chunked_output_loss`)
    the output layer's input gradient, made in the forward pass, is kept instead of its input, the
    logits, log-sum-exp and targets."""
    e, d, v, r = dtype_bytes(m.dtype), m.d_model, m.vocab_size, t if sp else 1
    terms: dict[str, float] = {"token_ids": 4 * s * b * pipeline}
    if m.dropout > 0:
        terms["embedding_dropout_mask"] = MASK_BYTES * s * b * d * pipeline / r
    if pipeline == 1 and loss_chunks > 1:
        terms |= {"final_norm_input": e * s * b * d / r, "output_layer_input_gradient": e * s * b * d / r}
    elif pipeline == 1:
        terms |= {"final_norm_input": e * s * b * d / r, "output_layer_input": e * s * b * d / r}
        terms |= {"logits": 4 * s * b * v / t, "logsumexp": 4 * s * b, "targets": 4 * s * b}
    return terms


def _unit_sum(terms: list[dict], kinds: list[int]) -> float:
    """A pipeline unit's layers' sum of `terms` (one dict per `layer_kinds` kind; `kinds`: `unit_kinds`).
    A policy that checkpoints whole layers (`full`, `dots`, `offload`: their `layer_input`) checkpoints
    a unit whole (`transformer.run_layers`): its input is stored once."""
    total = sum(sum(terms[i].values()) for i in kinds)
    return total - (len(kinds) - 1) * terms[0].get("layer_input", 0.0)


def activation_memory(
    cfg: RunConfig,
    *,
    policy: str | None = None,
    sequence_parallel: bool | None = None,
    pipeline: int | None = None,
    interleave: int | None = None,
) -> dict[str, object]:
    """Per-device activation bytes of a whole model: {'per_layer': {term: bytes}, 'layer_total',
    'layers', 'outside': {term: bytes}, 'total' (device), 'host_per_layer', 'host_total' (pinned
    host memory, offload policy), 'dense_per_layer'}. An MoE model with dense layers: 'per_layer'
    is an MoE layer's, 'dense_per_layer' a dense one's, and 'layer_total' the mean per layer.

    'layers' without a pipeline: L x layer_total. With one, stage 0's: the microbatch-chunks it
    holds at its peak (`pipeline_in_flight`) x L/(p v) layers each (uneven stages: ceil, pads
    stashed too). Megatron's (an explicit
    `pipeline`): P2's Eq. 5, L layers' worth (x (1 + (p-1)/(p v)) interleaved) when m > p. A run's
    own: interleaved the same; 1F1B in lockstep pairs (2p - 1)/p x L; GPipe m/p x L. A run's
    own pipeline (`parallel.stage`) lists its executor's buffers outside the layers; an explicit
    `pipeline` (P2's layouts) follows P2 4.3's outside terms. An MoE model with dense layers in a
    run's own pipeline: its chunks hold units of layers (`schedules.pipeline_unit`: MoE layers, or
    dense and MoE ones), and stage 0 one microbatch of the dense first layers ('dense_first_layers',
    outside: recomputed in the first chunk's backward)."""
    m, par, t = cfg.model, cfg.parallel, cfg.train
    policy = cfg.remat.policy if policy is None else policy
    sp = par.sequence_parallel if sequence_parallel is None else sequence_parallel
    b = t.global_batch // t.microbatches // par.batch_shards
    s = t.seq_len // par.context  # context parallelism: every stored tensor holds 1/c of the sequence
    ulysses = par.context if par.context_strategy == "all_to_all" else 1  # ... except Ulysses' scores
    kinds = layer_kinds(m)  # an MoE model with dense layers: their terms apart, the mean per layer
    split = par.context > 1
    each = [layer_activation_terms(k, s, b, par.tensor, sp, policy, ulysses, par.expert, split) for k, _ in kinds]
    # offload: the dot outputs `dots` would keep live in pinned host memory instead
    r = par.tensor if sp else 1
    host = [_dot_output_terms(k, s, b, par.tensor, r) if policy == "offload" else {} for k, _ in kinds]
    mean = lambda terms: sum(n * sum(x.values()) for x, (_, n) in zip(terms, kinds, strict=True)) / m.n_layers
    per_layer, host_per_layer = each[0], host[0]
    layer_total = sum(per_layer.values()) if len(kinds) == 1 else mean(each)
    from meshlm.pipeline_memory import pipeline_buffer_terms, pipeline_in_flight, region_inputs  # (imports this)

    own = pipeline is None and par.stage > 1
    p = par.stage if pipeline is None else pipeline
    v = par.virtual_stages if pipeline is None else (interleave or 1)
    unit = pipeline_unit(m) if own else None
    prefix = unit.prefix if unit else 0  # run with the embedding (docstring)
    # a chunk's slots (units of layers): uneven stages' pads (`schedules.chunk_layers`) are stashed like units
    slots = chunk_slots(unit.count, p * v) if unit else m.n_layers / (p * v)
    held = pipeline_in_flight(cfg, pipeline, interleave) * slots
    # what a slot stores: its unit's layers of each kind (MoE, dense), else the mean layer
    per_slot = lambda terms: _unit_sum(terms, unit_kinds(m)) if unit else mean(terms)
    stashed, host_slot = per_slot(each), per_slot(host)
    if own and par.pipeline_schedule in SPLIT:  # its weight slots hold the region inputs (outside)
        regions = [{n: x.get(n, 0.0) for n in region_inputs(k)} for x, (k, _) in zip(each, kinds, strict=True)]
        stashed -= per_slot(regions)
    layers = held * stashed
    if own:
        outside = pipeline_buffer_terms(
            dataclasses.replace(cfg, parallel=dataclasses.replace(par, sequence_parallel=sp))
        )
    else:
        outside = outside_activation_terms(m, s, b, par.tensor, sp, p, cfg.remat.loss_chunks)
    if prefix:
        outside["dense_first_layers"] = prefix * sum(each[1].values())
    e, mtp_host = dtype_bytes(m.dtype), 0.0
    if m.mtp_depth:  # each module: a layer of the first kind, and its own tensors (offload: its projection's output)
        mtp = mla_costs.mtp_module_terms(m, e, s, b, par.tensor, r, policy, cfg.remat.loss_chunks)
        outside["mtp_modules"] = m.mtp_depth * (sum(each[0].values()) + sum(mtp.values()))
        if policy == "offload":
            mtp_host = m.mtp_depth * (sum(host[0].values()) + e * s * b * m.d_model / r)
    return {
        "per_layer": per_layer,
        "layer_total": layer_total,
        "layers": layers,
        "outside": outside,
        "total": layers + sum(outside.values()),
        "host_per_layer": host_per_layer,
        "host_total": held * host_slot + mtp_host,
        "dense_per_layer": each[1] if len(kinds) > 1 else {},
    }
