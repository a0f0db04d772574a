"""Pipeline memory of a run's own executor (`parallel/pipeline.py`) and of Megatron's schedules:
the microbatch-chunks stage 0 holds in flight, and the buffers the executor keeps besides its stash
(`accounting.activation_memory` adds them to the layers' stored activations)."""

from __future__ import annotations

from meshlm.accounting import dtype_bytes, layer_activation_terms, layer_kinds, unit_kinds
from meshlm.config import ModelConfig, RunConfig
from meshlm.parallel.schedules import chunk_slots, first_stage_in_flight, megatron_in_flight, pipeline_unit
from meshlm.parallel.slots import slot_counts


def pipeline_in_flight(cfg: RunConfig, pipeline: int | None = None, interleave: int | None = None) -> int:
    """Microbatch-chunks whose stored activations stage 0 holds at its peak (1 without a pipeline).
    A run's own pipeline (`parallel.stage`) by its schedule; an explicit `pipeline` (P2's Table 3
    layouts) as Megatron runs it: 1F1B, interleaved when `interleave` > 1."""
    par, micro = cfg.parallel, cfg.train.microbatches
    if pipeline is None:
        if par.stage == 1:
            return 1
        return first_stage_in_flight(par.pipeline_schedule, par.stage, micro, par.virtual_stages, par.pipeline_ticks)
    if pipeline == 1:
        return 1
    # Megatron's asynchronous schedules; P2's Eq. 5 assumes a full pipeline (more microbatches than stages)
    return megatron_in_flight(pipeline, max(micro, 2 * pipeline), interleave or 1)


# the layer terms that are the inputs of its tensor-parallel regions, which zb1's weight slots keep
# instead of its stash (what a policy that recomputes them would not store either)
REGION_INPUTS = ("qkv_input", "out_proj_input", "mlp_input", "fc2_input", "down_input")


def region_inputs(m: ModelConfig) -> tuple[str, ...]:
    """`REGION_INPUTS` of one kind of layer: an MoE layer's are its attention's (the experts run in the
    MoE region, which zb1's weight pass does not defer)."""
    return REGION_INPUTS[:2] if m.moe else REGION_INPUTS


def pipeline_buffer_terms(cfg: RunConfig) -> dict[str, float]:
    """What meshlm's executor (`parallel/pipeline.py`) keeps besides the stash: every microbatch's
    token ids and targets, and the inboxes of arrived activations and cotangents ([b, s, d] each,
    sequence-sharded under SP) with their spare slots, sized by the schedule's table (all of them 1/c
    of the sequence under context parallelism). zb1 also keeps, per weight slot (the pending weight
    passes' peak + a spare) and layer of the chunk, the inputs and the output gradients of the
    layer's tensor-parallel regions (whatever the remat policy), and one chunk's region inputs on
    their way to a slot; its stash then holds no region
    input (`activation_memory` leaves `region_inputs` out of its layers' term). A unit of dense and
    MoE layers (`schedules.pipeline_unit`): each of its layers' regions (an MoE layer's: attention's)."""
    m, par, t = cfg.model, cfg.parallel, cfg.train
    shape = (par.pipeline_schedule, par.stage, t.microbatches, par.virtual_stages, par.pipeline_ticks)
    act_slots, grad_slots, weight_slots = slot_counts(*shape)
    b = t.global_batch // t.microbatches // par.batch_shards
    r = par.tensor if par.sequence_parallel else 1
    e, s = dtype_bytes(m.dtype), t.seq_len // par.context  # each context rank: its 1/c of the sequence
    slot = e * s * b * m.d_model / r
    terms = {
        "token_ids_and_targets": 8 * s * b * t.microbatches,
        "activation_inbox": act_slots * slot,
        "cotangent_inbox": grad_slots * slot,
    }
    if weight_slots:
        unit, kinds = pipeline_unit(m), layer_kinds(m)  # a chunk's slots: units of layers of these kinds
        per_chunk = chunk_slots(unit.count, par.stage * par.virtual_stages)
        rows = e * s * b / par.tensor
        inputs = grads = 0.0
        for k in (kinds[i][0] for i in unit_kinds(m)):
            # QKV's and the MLP's inputs (the residual stream), the output projections' (heads, MLP width):
            # the layer terms the stash of the elementwise policy keeps for them
            layer = layer_activation_terms(k, s, b, par.tensor, par.sequence_parallel)
            inputs += sum(layer.get(n, 0.0) for n in region_inputs(k))
            # Q, K, V, gpt's fc1 or llama's gate and up, and the two row-parallel outputs (MoE: attention's)
            mlp = 0 if k.moe else (1 if k.family == "gpt" else 2) * k.ffn
            grads += rows * ((k.n_heads + 2 * k.kv_heads) * k.dim_head + mlp) + (1 if k.moe else 2) * slot
        terms["weight_pass_region_inputs"] = (weight_slots + 1) * per_chunk * inputs  # + the one waiting
        terms["weight_pass_output_gradients"] = weight_slots * per_chunk * grads
    return terms
