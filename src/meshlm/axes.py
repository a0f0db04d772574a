"""The logical-axis vocabulary. Model code names axes with these; `parallel/rules.py` maps them
to mesh axes. Parameters and activations use different names so that a weight dimension can be
sharded (FSDP) without forcing the activation that flows through it to follow.

The mesh axes are named here too: the one list that config, the mesh and the rules table use.

Imports nothing on purpose.
"""

# Mesh axes, outermost first (`parallel.mesh.make_mesh` says why in this order).
MESH_AXES = ("stage", "data", "fsdp", "expert", "context", "tensor")
# The axes that split the batch (rows): every data-like axis; `expert` also shards the MoE experts.
BATCH_AXES = ("data", "fsdp", "expert")

# Parameter axes.
LAYERS = "layers"  # the stacked-layer axis scanned by lax.scan
VOCAB = "vocab"
EMBED = "embed"  # the model dimension h of a weight
POS = "pos"  # rows of the learned position table
HEADS = "heads"
KV_HEADS = "kv_heads"
HEAD_DIM = "head_dim"
MLP = "mlp"
EXPERT = "expert"  # the stacked experts of an MoE layer

# Activation axes.
BATCH = "batch"
SEQ = "seq"  # sequence inside tensor-parallel blocks (never sharded)
ACT_SEQ = "act_seq"  # sequence in the LayerNorm/dropout/residual regions (sequence parallelism)
ACT_EMBED = "act_embed"
ACT_HEADS = "act_heads"
ACT_KV_HEADS = "act_kv_heads"
ACT_MLP = "act_mlp"
ACT_VOCAB = "act_vocab"

PARAM_AXES = (LAYERS, VOCAB, EMBED, POS, HEADS, KV_HEADS, HEAD_DIM, MLP, EXPERT)
ACTIVATION_AXES = (BATCH, SEQ, ACT_SEQ, ACT_EMBED, ACT_HEADS, ACT_KV_HEADS, ACT_MLP, ACT_VOCAB)
