"""Document-aware attention: no attention across end-of-text boundaries in a packed row."""

import jax
import numpy as np
import pytest

from meshlm.config import ModelConfig
from meshlm.data.loader import document_segments
from meshlm.model.params import init_params, param_specs
from meshlm.model.transformer import forward

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


# Sharded training with document masks: raw gradients on every layout, tests/test_gradients.py.
