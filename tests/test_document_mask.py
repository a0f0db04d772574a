"""Document-aware attention: no attention across end-of-text boundaries in a packed row."""

import dataclasses

import jax
import numpy as np
import pytest

from helpers import build, random_batches, tiny_config
from meshlm.config import DataConfig, ModelConfig, validate
from meshlm.data.loader import document_segments
from meshlm.model.params import init_params, param_specs
from meshlm.model.transformer import forward
from meshlm.step import make_train_step

EOT = 0


def _model(family: str, attention: str = "explicit") -> ModelConfig:
    kv = 2 if family == "llama" else 0
    return ModelConfig(
        family=family, vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=kv, attention=attention
    )


@pytest.mark.parametrize("family,attention", [("gpt", "explicit"), ("llama", "explicit"), ("gpt", "fused")])
def test_a_packed_document_sees_only_itself(family, attention):
    """Logits of document B packed after document A equal B's logits alone at the row start."""
    cfg = _model(family, attention)
    params = init_params(param_specs(cfg), jax.random.key(0))
    rng = np.random.default_rng(0)
    a = np.append(rng.integers(1, 64, 9), EOT)
    b = rng.integers(1, 64, 14)
    packed = np.concatenate([a, b])[None].astype(np.int32)
    doc = document_segments(packed, EOT)
    logits = forward(params, packed, cfg, segment_ids=doc["segment_ids"], positions=doc["positions"])
    alone = forward(params, b[None].astype(np.int32), cfg)
    np.testing.assert_allclose(np.asarray(logits[0, len(a) :]), np.asarray(alone[0]), rtol=2e-5, atol=2e-5)
    unmasked = forward(params, packed, cfg)
    assert not np.allclose(np.asarray(unmasked[0, len(a) :]), np.asarray(alone[0]), atol=1e-3)  # it matters


def _doc_batches(cfg, n):
    out = []
    for b in random_batches(cfg, n, seed=1):
        inputs = np.where(np.random.default_rng(2).random(b["inputs"].shape) < 0.1, EOT, b["inputs"])
        out.append({"inputs": inputs, "targets": b["targets"]} | document_segments(inputs, EOT))
    return out


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_sharded_document_mask_matches_one_device(family):
    base = tiny_config(family, steps=2, global_batch=8)
    base = dataclasses.replace(base, model=dataclasses.replace(base.model, dropout=0.0))
    base = validate(dataclasses.replace(base, data=DataConfig(document_mask=True)))
    batches = _doc_batches(base, 2)
    losses = {}
    for name, mesh in {"single": dict(data=1), "tp_sp": dict(data=2, tensor=4, sequence_parallel=True)}.items():
        cfg = validate(dataclasses.replace(base, parallel=dataclasses.replace(base.parallel, **mesh)))
        layout, _, tx, shardings, state = build(cfg)
        step = make_train_step(cfg, layout, tx, shardings)
        losses[name] = []
        for b in batches:
            state, m = step(state, b)
            losses[name].append(float(m["loss"]))
    np.testing.assert_allclose(losses["tp_sp"], losses["single"], rtol=1e-5)
