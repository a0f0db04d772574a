"""RoPE's frequency scaling as arithmetic on the config (no JAX): what `layers.rope_inv_freq` and
`layers.rotate` take, and YaRN's two attention factors."""

from __future__ import annotations

import math

from meshlm.config import ModelConfig


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's attention temperature term: 0.1 mscale ln(factor) + 1 (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def scaling(m: ModelConfig) -> tuple | None:
    """`model.rope_scaling` as `layers.rope_inv_freq` takes it: None, ("llama3", factor, low freq
    factor, high freq factor, original length) or ("yarn", factor, beta_fast, beta_slow, original length)."""
    if m.rope_scaling == "llama3":
        return ("llama3", m.rope_factor, m.rope_low_freq_factor, m.rope_high_freq_factor, m.rope_original_len)
    if m.rope_scaling == "yarn":
        return ("yarn", m.rope_factor, m.yarn_beta_fast, m.yarn_beta_slow, m.rope_original_len)
    return None


def attention_factor(m: ModelConfig) -> float:
    """YaRN's scale of the rotated parts of q and k: mscale(factor, mscale) / mscale(factor,
    mscale_all_dim) when both are set, else mscale(factor, 1) (as `transformers`); 1 without YaRN."""
    if m.rope_scaling != "yarn":
        return 1.0
    if m.yarn_mscale and m.yarn_mscale_all_dim:
        return yarn_mscale(m.rope_factor, m.yarn_mscale) / yarn_mscale(m.rope_factor, m.yarn_mscale_all_dim)
    return yarn_mscale(m.rope_factor, 1.0)


def softmax_factor(m: ModelConfig) -> float:
    """MLA's factor on the softmax scale 1/sqrt(dim_head): YaRN's mscale(factor, mscale_all_dim)^2
    (DeepSeek-V3; `transformers`' `yarn_apply_mscale`), else 1. Other attention has none."""
    if not m.mla or m.rope_scaling != "yarn" or not m.yarn_mscale_all_dim:
        return 1.0
    return yarn_mscale(m.rope_factor, m.yarn_mscale_all_dim) ** 2
