"""Hugging Face in and out, generation with a KV cache, and evaluation, checked against the real
thing: checkpoints written by `transformers` (random weights, sharded safetensors), read back by
`transformers` and the `safetensors` package, greedy tokens of `transformers`' `generate`."""

import dataclasses
import json
import logging
import math
import os
import pickle
import struct

import jax
import numpy as np
import pytest

from meshlm import inference
from meshlm.cli import main
from meshlm.config import ParallelConfig, RunConfig
from meshlm.interop import hf, hf_tables
from meshlm.interop import safetensors_io as st
from meshlm.model.params import param_specs
from meshlm.model.transformer import forward
from meshlm.parallel.mesh import make_layout
from meshlm.train_state import param_shardings

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

TENSOR4 = ParallelConfig(tensor=4)


def _hf_model(name: str):
    if name == "gpt2":
        c = transformers.GPT2Config(
            vocab_size=128, n_embd=64, n_layer=2, n_head=8, n_positions=64, bos_token_id=0, eos_token_id=0
        )
        return transformers.GPT2LMHeadModel(c)
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    c = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,  # GQA: 2 query heads per kv head, 1 kv head per rank at tensor=4
        rms_norm_eps=1e-5,
        tie_word_embeddings=name == "llama-tied",
        rope_scaling=llama3 | {"original_max_position_embeddings": 16} if name == "llama-tied" else None,
        rope_theta=500.0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return transformers.LlamaForCausalLM(c)


NAMES = ("gpt2", "llama-gqa", "llama-tied")


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """{name: (directory, model)}: random models with every parameter perturbed (so norms and
    biases matter), saved by `transformers` as several safetensors files plus an index."""
    out = {}
    for i, name in enumerate(NAMES):
        torch.manual_seed(i)
        model = _hf_model(name).eval()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.1 * torch.randn_like(p))
        d = tmp_path_factory.mktemp(name)
        model.save_pretrained(d, max_shard_size="40KB")
        assert (d / hf.SAFE_INDEX).is_file() and len(list(d.glob("*.safetensors"))) > 2
        out[name] = (d, model)
    return out


def _hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(tokens.astype(np.int64))).logits.numpy()


def _tokens(b=2, t=24, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 128, (b, t)).astype(np.int32)


@pytest.mark.parametrize("name", NAMES)
def test_import_gives_transformers_logits_on_one_device_and_tensor4(hf_dirs, name, devices):
    d, model = hf_dirs[name]
    tokens = _tokens()
    want = _hf_logits(model, tokens)
    cfg = hf_tables.model_config(d)
    for parallel in (ParallelConfig(), TENSOR4):
        layout = make_layout(parallel)
        params = hf.load_params(d, cfg, param_shardings(param_specs(cfg), layout))
        if parallel.tensor > 1:  # built straight into shards: each device holds its heads only
            wq = params["layers"]["wq"]
            assert {s.data.shape[2] for s in wq.addressable_shards} == {cfg.n_heads // 4}
        got = np.asarray(jax.jit(lambda p, t, c=cfg, lay=layout: forward(p, t, c, lay))(params, tokens))
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def _safetensors(d) -> dict:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out |= safetensors_torch.load_file(f)
    return out


@pytest.mark.parametrize("name", NAMES)
def test_export_writes_back_the_same_tensors(hf_dirs, name, tmp_path, devices):
    """Import then export gives back every tensor of the original bit for bit (read by the
    `safetensors` package), sharded with an index; bf16 export = torch's bf16 cast; and
    `transformers` loads the export to the original logits."""
    d, model = hf_dirs[name]
    cfg = hf_tables.model_config(d)
    params = hf.load_params(d, cfg, param_shardings(param_specs(cfg), make_layout(TENSOR4)))
    out = hf.save_pretrained(params, cfg, tmp_path / "fp32", max_shard_bytes=60_000, log=lambda m: None)
    assert (out / hf.SAFE_INDEX).is_file()
    index = json.loads((out / hf.SAFE_INDEX).read_text())
    original, exported = _safetensors(d), _safetensors(out)
    assert set(index["weight_map"]) == set(exported)
    assert set(exported) == set(original) - ({"lm_head.weight"} if model.config.tie_word_embeddings else set())
    for k, v in exported.items():
        assert torch.equal(v, original[k]), k
    written = json.loads((out / "config.json").read_text())
    assert written["torch_dtype"] == written["dtype"] == "float32"  # transformers 4 and 5 spellings
    if name != "gpt2":
        assert written["max_position_embeddings"] == model.config.max_position_embeddings
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokens = _tokens()
    np.testing.assert_array_equal(_hf_logits(reloaded, tokens), _hf_logits(model, tokens))
    bf16 = hf.save_pretrained(params, cfg, tmp_path / "bf16", dtype="bfloat16", log=lambda m: None)
    for k, v in _safetensors(bf16).items():
        assert v.dtype == torch.bfloat16 and torch.equal(v, original[k].to(torch.bfloat16)), k
    # ... and meshlm reads bf16 files (NumPy has no bfloat16; ml_dtypes does)
    again = hf.load_params(bf16, cfg, param_shardings(param_specs(cfg), make_layout(ParallelConfig())))
    embed = original["transformer.wte.weight" if name == "gpt2" else "model.embed_tokens.weight"]
    np.testing.assert_array_equal(np.asarray(again["wte"]), embed.to(torch.bfloat16).float().numpy())


def test_gpt2_files_without_prefix_and_with_mask_buffers_import(hf_dirs, tmp_path, devices):
    """OpenAI's GPT-2 upload names tensors without "transformer." and carries causal-mask buffers."""
    d = tmp_path / "openai-style"
    d.mkdir()
    (d / "config.json").write_bytes((hf_dirs["gpt2"][0] / "config.json").read_bytes())
    tensors = {k.removeprefix("transformer."): v for k, v in _safetensors(hf_dirs["gpt2"][0]).items()}
    tensors["h.0.attn.bias"] = torch.ones(1, 1, 64, 64)
    safetensors_torch.save_file(tensors, d / hf.SAFE_SINGLE)
    cfg = hf_tables.model_config(d)
    params = hf.load_params(d, cfg, param_shardings(param_specs(cfg), make_layout(ParallelConfig())))
    tokens = _tokens()
    got = np.asarray(jax.jit(lambda p, t: forward(p, t, cfg))(params, tokens))
    np.testing.assert_allclose(got, _hf_logits(hf_dirs["gpt2"][1], tokens), atol=1e-4, rtol=0)


# ---------------------------------------------------------------------------------- generation


def _model(hf_dirs, name, parallel):
    d, _ = hf_dirs[name]
    cfg = hf_tables.model_config(d)
    layout = make_layout(parallel)
    params = hf.load_params(d, cfg, param_shardings(param_specs(cfg), layout))
    stops = hf.token_ids(d)["eos_token_id"]
    return inference.Model(RunConfig(model=cfg, parallel=parallel), params, layout, None, stops[0], "", tuple(stops))


PROMPTS = [[5, 6, 7, 8, 9], [11, 12], [20 + i for i in range(19)]]  # three lengths in one batch


@pytest.mark.parametrize(
    "name, attention", [("gpt2", "explicit"), ("llama-gqa", "explicit"), ("llama-gqa", "blockwise")]
)
def test_kv_cache_decode_equals_full_recomputation_and_transformers(hf_dirs, name, attention, devices):
    """Tensor-parallel decode (tensor=4) of a left-padded batch: each new token's logits equal a
    full forward pass over prompt + generated tokens on one device, and the greedy tokens are
    `transformers`' greedy `generate` for each prompt alone. (blockwise: the prefill attends among
    the prompt tokens with the blockwise kernel, padding as its own document.)"""
    model = _model(hf_dirs, name, TENSOR4)
    model.cfg = dataclasses.replace(
        model.cfg, model=dataclasses.replace(model.cfg.model, attention=attention, attention_block=8)
    )
    gen = inference.Generator(model).generate(PROMPTS, 12, return_logits=True, stop_at_eos=False)
    cfg, params = model.cfg.model, model.params
    for i, prompt in enumerate(PROMPTS):
        assert len(gen.tokens[i]) == 12
        seq = np.asarray([prompt + gen.tokens[i]], np.int32)
        full = np.asarray(jax.jit(lambda p, t: forward(p, t, cfg))(params, seq))[0, len(prompt) - 1 : -1]
        np.testing.assert_allclose(gen.logits[i], full, atol=2e-5, rtol=0)
        want = hf_dirs[name][1].generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)
        want = want[0, len(prompt) :].tolist()  # transformers stops at its end-of-text token
        assert want == gen.tokens[i][: len(want)] and (len(want) == 12 or want[-1] == model.eos_id)


def test_sampling_is_reproducible_and_filters(hf_dirs, devices):
    g = inference.Generator(_model(hf_dirs, "llama-gqa", ParallelConfig()))
    opts = dict(temperature=1.0, top_k=20, top_p=0.9, stop_at_eos=False)
    a, b, c = (g.generate(PROMPTS, 8, seed=s, **opts).tokens for s in (3, 3, 4))
    assert a == b and a != c
    greedy = g.generate(PROMPTS, 8, stop_at_eos=False).tokens
    # compile apart from the steady rate: a fresh generator's first decode step compiles the decode
    # program and is timed alone; the rate counts the 6 decode steps after it (8 tokens = the prefill's
    # + 7 decode steps), each far shorter than that first one
    out = inference.Generator(g.model).generate(PROMPTS, 8, stop_at_eos=False)
    assert out.tokens == greedy and out.decode_steps == 6 and out.decode_s > 0
    assert out.decode_s / out.decode_steps < out.first_decode_s / 3, (out.first_decode_s, out.decode_s)
    assert g.generate(PROMPTS, 8, temperature=1.0, top_k=1, seed=5, stop_at_eos=False).tokens == greedy
    # The filters on known distributions: probabilities 0.6, 0.3, 0.1 (and nothing else).
    logits = jax.numpy.log(jax.numpy.asarray([[0.6, 0.3, 0.1, 1e-12]]))
    draws = lambda **kw: {int(inference.sample(logits, jax.random.key(i), 1.0, **kw)[0]) for i in range(200)}
    assert draws(top_k=0, top_p=0.5) == {0}
    assert draws(top_k=0, top_p=0.8) == {0, 1}
    assert draws(top_k=2, top_p=1.0) == {0, 1}
    assert draws(top_k=0, top_p=1.0) == {0, 1, 2}
    assert int(inference.sample(jax.numpy.asarray(logits), jax.random.key(0), 0.0, 0, 1.0)[0]) == 0


def test_generation_stops_at_end_of_text_and_checks_its_input(hf_dirs, devices):
    model = _model(hf_dirs, "gpt2", ParallelConfig())
    g = inference.Generator(model)
    free = g.generate(PROMPTS, 12, stop_at_eos=False).tokens
    model.stop_ids = (free[0][3],)  # pretend the 4th token of row 0 ends a text
    stopped = g.generate(PROMPTS, 12).tokens
    assert len(stopped[0]) <= 4 and stopped[0][-1] == free[0][3]
    for row, full in zip(stopped, free, strict=True):  # each row ends at its first stop token
        assert row == (full[: full.index(free[0][3]) + 1] if free[0][3] in full else full)
    # several stop ids (Llama 3 Instruct has two); when every row has stopped, decoding ends early
    model.stop_ids = tuple({row[1] for row in free})
    out = g.generate(PROMPTS, 40)
    assert all(len(row) <= 2 for row in out.tokens) and out.decode_steps < 39
    assert len(g.generate(PROMPTS, 3, temperature=1.0, top_k=10**6).tokens[0]) <= 3  # top_k past the vocabulary
    with pytest.raises(Exception, match="exceeds the model's 64 positions"):
        g.generate(PROMPTS, 60)
    with pytest.raises(Exception, match="outside the vocabulary"):
        g.generate([[1, 500]], 2)


# ------------------------------------------------------------------------------------ bad input


def _convert(args, capsys) -> tuple[int, str]:
    code = main(["convert", *map(str, args)])
    return code, capsys.readouterr().err


def _copy(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_pickled_weights_are_refused_without_unpickling(tmp_path, monkeypatch, capsys):
    d = tmp_path / "pickled"
    d.mkdir()
    model = _hf_model("gpt2")
    model.config.save_pretrained(d)
    torch.save(model.state_dict(), d / "pytorch_model.bin")  # a real pickle
    calls = []
    for mod, name in [(pickle, "load"), (pickle, "loads"), (pickle, "Unpickler"), (torch, "load")]:
        monkeypatch.setattr(mod, name, lambda *a, _n=name, **k: calls.append(_n))
    code, err = _convert(["--from-hf", d, "--to", tmp_path / "run"], capsys)
    assert code == 2 and "pytorch_model.bin" in err and "never unpickles" in err, err
    assert "save_pretrained" in err  # says how to convert them
    assert calls == [] and not (tmp_path / "run").exists()
    args = ["train", "--init-from", f"hf:{d}", "--run-dir", str(tmp_path / "r2"), "--set", "train.seq_len=32"]
    code, err = main(args), capsys.readouterr().err
    assert code == 2 and "never unpickles" in err and calls == []


def _edit_config(d, **changes):
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(cfg | changes))


def _rewrite_weights(d, edit):
    """Rewrite the checkpoint as one model.safetensors after `edit(dict of tensors)`."""
    tensors = _safetensors(d)
    edit(tensors)
    for f in [*list(d.glob("*.safetensors")), d / hf.SAFE_INDEX]:
        f.unlink()
    safetensors_torch.save_file(tensors, d / hf.SAFE_SINGLE)


@pytest.mark.parametrize(
    "break_it, message",
    [
        (lambda d: _edit_config(d, n_embd="64"), "n_embd must be an integer >= 1, got '64'"),
        (lambda d: _edit_config(d, model_type="bert"), "model_type 'bert'"),
        (lambda d: _edit_config(d, activation_function="relu"), "activation_function='relu' is not supported"),
        (lambda d: _edit_config(d, layer_norm_epsilon=float("nan")), "layer_norm_epsilon must be a finite number"),
        (
            lambda d: _edit_config(d, n_positions=32),
            "tensor transformer.wpe.weight has shape [64, 64], expected [32, 64]",
        ),
        (
            lambda d: _rewrite_weights(d, lambda t: t.pop("transformer.h.1.mlp.c_fc.bias")),
            "missing tensor transformer.h.1.mlp.c_fc.bias",
        ),
        (lambda d: _rewrite_weights(d, lambda t: t.update(extra=torch.zeros(2))), "unexpected tensor extra"),
        (lambda d: (d / "config.json").write_text("{not json"), "cannot read"),
        (lambda d: _edit_config(d, n_layer=3), "config.json says 3 layers, but the weights hold layers [0, 1]"),
        (
            lambda d: _rewrite_weights(
                d, lambda t: t.update({"transformer.ln_f.bias": torch.zeros(64, dtype=torch.int32)})
            ),
            "stored as integers or booleans (quantized weights?) are not supported: transformer.ln_f.bias (I32)",
        ),
        (
            lambda d: (d / "generation_config.json").write_text('{"eos_token_id": "x"}'),
            "eos_token_id must be a token id or a list of them, got 'x'",
        ),
        (
            lambda d: [f.write_bytes(struct.pack("<Q", 10**6) + b"{}") for f in d.glob("*.safetensors")],
            "is not a valid safetensors file",
        ),
    ],
)
def test_bad_checkpoints_are_named_and_nothing_is_written(hf_dirs, tmp_path, capsys, break_it, message):
    d = _copy(hf_dirs["gpt2"][0], tmp_path / "hf")
    break_it(d)
    code, err = _convert(["--from-hf", d, "--to", tmp_path / "run"], capsys)
    assert code == 2 and message in err, err
    assert not (tmp_path / "run").exists() and not list(tmp_path.glob(".run.*"))


def test_a_failure_while_writing_leaves_nothing(hf_dirs, tmp_path, monkeypatch, capsys, devices):
    """Import and export fail half-way (after files were written): no destination, no temporary."""
    from meshlm.checkpoint import Checkpointer

    real_write, calls = st.write, []

    def write_then_fail(*args, **kwargs):
        calls.append(1)
        real_write(*args, **kwargs)
        if len(calls) == 2:
            raise OSError("No space left on device")

    d = hf_dirs["gpt2"][0]
    cfg = hf_tables.model_config(d)
    params = hf.load_params(d, cfg, param_shardings(param_specs(cfg), make_layout(ParallelConfig())))
    monkeypatch.setattr(st, "write", write_then_fail)
    with pytest.raises(OSError, match="No space"):
        hf.save_pretrained(params, cfg, tmp_path / "out", max_shard_bytes=60_000, log=lambda m: None)
    assert len(calls) == 2 and not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.*"))

    def save_then_fail(self, *args, **kwargs):
        Checkpointer.save_params.__wrapped__(self, *args, **kwargs)
        raise OSError("No space left on device")

    save_then_fail.__wrapped__ = Checkpointer.save_params
    monkeypatch.setattr(Checkpointer, "save_params", save_then_fail)
    with pytest.raises(OSError, match="No space"):
        main(["convert", "--from-hf", str(d), "--to", str(tmp_path / "run")])
    assert not (tmp_path / "run").exists() and not list(tmp_path.glob(".run.*"))


def test_convert_and_generate_name_what_is_wrong(tmp_path, capsys, devices):
    code, err = _convert(["--from", f"hf:{tmp_path}", "--to-hf", tmp_path / "x"], capsys)
    assert code == 2 and "already a Hugging Face directory" in err
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.json").write_text(RunConfig().to_json())
    code = main(["generate", "--run-dir", str(run), "--prompt", "hi"])
    err = capsys.readouterr().err
    assert code == 2 and "--run-dir: no checkpoint under" in err, err


def test_llama_rope_types_meshlm_does_not_compute_are_refused(hf_dirs, tmp_path):
    d = _copy(hf_dirs["llama-gqa"][0], tmp_path / "hf")
    _edit_config(d, rope_parameters={"rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0})
    with pytest.raises(Exception, match="RoPE type 'yarn' is not supported"):
        hf_tables.model_config(d)
    # transformers 4's spelling (rope_theta + rope_scaling) reads the same as 5's rope_parameters
    _edit_config(d, rope_parameters=None, rope_theta=321.0, rope_scaling=None)
    assert hf_tables.model_config(d).rope_theta == 321.0 and hf_tables.model_config(d).rope_scaling == "none"


# ------------------------------------------------------------- the default job, out and back in


def _hf_window_loss(model, tokens: np.ndarray, seq_len: int) -> tuple[float, int]:
    """Summed next-token NLL of `tokens` in windows of seq_len + 1 overlapping by one, in torch."""
    total, count = 0.0, 0
    for i in range(0, len(tokens) - 1, seq_len):
        piece = torch.from_numpy(tokens[i : i + seq_len + 1].astype(np.int64))[None]
        with torch.no_grad():
            logp = torch.log_softmax(model(piece[:, :-1]).logits.double(), -1)
        total -= logp.gather(-1, piece[:, 1:, None]).sum().item()
        count += piece.shape[1] - 1
    return total, count


@pytest.mark.slow
def test_default_job_exports_generates_and_evaluates_like_transformers(default_run, tmp_path, capsys, caplog, devices):
    """The README's trained model: exported, loaded by `transformers` (model and tokenizer) to
    the same logits; `meshlm generate` greedy = `transformers` greedy; `meshlm eval` = the loss
    `transformers` computes on the same windows; imported back, it evaluates the same."""
    out = tmp_path / "hf"
    assert main(["convert", "--from", str(default_run), "--to-hf", str(out), "--max-shard-size", "1MiB"]) == 0
    assert (out / hf.SAFE_INDEX).is_file()
    ref = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tok = transformers.AutoTokenizer.from_pretrained(out)
    model = inference.load_model(default_run)
    prompt = "def read_config(path):\n    with open(path) as f:"
    ids = model.encode(prompt)
    assert tok(prompt)["input_ids"] == ids and tok.decode(ids) == prompt
    tokens = np.asarray([ids], np.int32)
    logits = np.asarray(jax.jit(lambda p, t: forward(p, t, model.cfg.model))(model.params, tokens))
    np.testing.assert_allclose(logits, _hf_logits(ref, tokens), atol=1e-4, rtol=0)

    capsys.readouterr()
    args = ["--prompt", prompt, "--temperature", "0", "--max-new-tokens", "24", "--json"]
    assert main(["generate", "--run-dir", str(default_run), *args]) == 0
    generated = json.loads(capsys.readouterr().out)
    orbax_warnings = [r.getMessage() for r in caplog.records if r.name == "absl" and r.levelno >= logging.WARNING]
    assert not orbax_warnings  # a read-only checkpoint (generate, eval) is no news to the user
    assert {"prefill_s", "first_decode_s", "decode_s", "decode_steps"} <= generated.keys()  # compile apart
    m = model.cfg.model  # keys and values of every head and layer, float32
    assert generated["cache_bytes_per_token"] == m.n_layers * 2 * m.n_heads * m.dim_head * 4
    ours = generated["completions"][0]
    want = ref.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids) :].tolist()
    assert ours["tokens"] == want[: len(ours["tokens"])] and len(ours["tokens"]) == min(24, len(want))
    assert ours["completion"] == tok.decode(want[: len(ours["tokens"])], skip_special_tokens=True)
    # the Python API, and the exported directory read directly (hf:DIR), say the same
    import meshlm

    assert meshlm.generate(default_run, prompt, 24, temperature=0) == ours["completion"]
    assert main(["generate", "--run-dir", f"hf:{out}", *args]) == 0
    assert json.loads(capsys.readouterr().out)["completions"][0]["tokens"] == ours["tokens"]

    assert main(["eval", "--run-dir", str(default_run), "--max-tokens", "2000", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    data = json.loads((default_run / "run.json").read_text())["data_root"]
    from meshlm.data.prepare import load

    stream = np.asarray(load(data).tokens("val")[:2001], np.int32)
    total, count = _hf_window_loss(ref, stream, model.cfg.train.seq_len)
    assert result["tokens"] == count == 2000
    assert result["loss"] == pytest.approx(total / count, abs=1e-4)
    assert result["bytes"] == len(tok.decode(stream[1:].tolist(), skip_special_tokens=True).encode())
    assert result["bits_per_byte"] == pytest.approx(total / math.log(2) / result["bytes"], rel=1e-4)

    text = tmp_path / "notes.txt"  # raw text: tokenized with the run's tokenizer
    text.write_text("import os\n\ndef main():\n    print(os.getcwd())\n")
    assert main(["eval", "--run-dir", str(default_run), "--data", str(text), "--json"]) == 0
    raw = json.loads(capsys.readouterr().out)
    ids = [*model.encode(text.read_text()), model.eos_id]
    assert raw["tokens"] == len(ids) - 1 and raw["bytes"] == len(model.decode(ids[1:]).encode())
    total, count = _hf_window_loss(ref, np.asarray(ids), model.cfg.train.seq_len)
    assert raw["loss"] == pytest.approx(total / count, abs=1e-4)

    assert main(["eval", "--run-dir", str(default_run), "--max-tokens", "2000", "--json", "--mesh", "data=2"]) == 0
    assert json.loads(capsys.readouterr().out)["loss"] == pytest.approx(result["loss"], abs=1e-5)

    # an imported model's own tokenizer/generation settings travel through import and export
    (out / "chat_template.jinja").write_text("{{ messages }}")
    gen = json.loads((out / "generation_config.json").read_text())
    (out / "generation_config.json").write_text(json.dumps(gen | {"eos_token_id": [gen["eos_token_id"], 5]}))
    back = tmp_path / "reimported"
    assert main(["convert", "--from-hf", str(out), "--to", str(back)]) == 0
    capsys.readouterr()
    assert main(["eval", "--run-dir", str(back), "--data", data, "--max-tokens", "2000", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["loss"] == pytest.approx(result["loss"], abs=1e-6)
    assert inference.load_model(back).stops == (gen["eos_token_id"], 5)
    again = tmp_path / "again"
    assert main(["convert", "--from", str(back), "--to-hf", str(again)]) == 0
    assert (again / "chat_template.jinja").read_text() == "{{ messages }}"
    assert json.loads((again / "generation_config.json").read_text())["eos_token_id"] == [gen["eos_token_id"], 5]
    # a weights-only checkpoint is not a run to resume
    code = main(["train", "--run-dir", str(back), "--steps", "1"])
    assert code == 2 and "holds weights only" in capsys.readouterr().err


@pytest.mark.slow
def test_train_init_from_hf_uses_its_model_and_tokenizer(default_run, corpus_dir, tmp_path, capsys, devices):
    """`--init-from` takes the source's model config and tokenizer, whatever the recipe says: from
    a Hugging Face directory, from the meshlm run it was exported from, and from the run directory
    `convert --from-hf` makes of it, the first loss is the same (the recipe here is llama-tiny, the
    source a gpt). A dataset prepared with another tokenizer is refused."""
    out = tmp_path / "hf"
    assert main(["convert", "--from", str(default_run), "--to-hf", str(out)]) == 0
    converted = tmp_path / "converted"
    assert main(["convert", "--from-hf", str(out), "--to", str(converted)]) == 0
    umask = os.umask(0)
    os.umask(umask)
    for d in (out, converted):  # readable as the umask allows (not mkdtemp's private 0700)
        assert d.stat().st_mode & 0o777 == 0o777 & ~umask
    common = [
        "--recipe",
        "llama-tiny",
        "--steps",
        "1",
        "--set",
        f"data.paths={corpus_dir}",
        "--set",
        "train.log_every=1",
    ]
    first = {}
    for name, source in [("hf", f"hf:{out}"), ("meshlm", str(default_run)), ("converted", str(converted))]:
        assert main(["train", "--init-from", source, "--run-dir", str(tmp_path / f"run-{name}"), *common]) == 0
        records = [json.loads(x) for x in (tmp_path / f"run-{name}" / "metrics.jsonl").read_text().splitlines()]
        first[name] = next(r["loss"] for r in records if "loss" in r)
        assert (tmp_path / f"run-{name}" / "tokenizer.json").read_bytes() == (out / "tokenizer.json").read_bytes()
        assert json.loads((tmp_path / f"run-{name}" / "config.json").read_text())["model"]["family"] == "gpt"
        if name != "meshlm":  # a Hugging Face model's own settings (stop ids, chat template) stay with it
            assert (tmp_path / f"run-{name}" / "generation_config.json").read_bytes() == (
                out / "generation_config.json"
            ).read_bytes()
    assert first["hf"] == pytest.approx(first["meshlm"], abs=1e-5)
    assert first["converted"] == pytest.approx(first["meshlm"], abs=1e-5)
    prepared = tmp_path / "other"
    assert main(["data", "prepare", "--input", str(corpus_dir), "--out", str(prepared), "--vocab-size", "300"]) == 0
    capsys.readouterr()
    code = main(
        [
            "train",
            "--init-from",
            f"hf:{out}",
            "--run-dir",
            str(tmp_path / "r2"),
            "--steps",
            "1",
            "--set",
            f"data.paths={prepared}",
        ]
    )
    assert code == 2 and "tokenizer" in capsys.readouterr().err


def test_check_full_on_a_hugging_face_models_own_weights(hf_dirs, capsys, devices):
    """`meshlm check --init-from hf:DIR --full`: the model's real shapes and weights, its layout
    against one device (tensor=2 splits the GQA model's 2 kv heads)."""
    d, _ = hf_dirs["llama-gqa"]
    assert main(["check", "--init-from", f"hf:{d}", "--full", "--mesh", "tensor=2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    cfg = hf_tables.model_config(d)
    assert out["verdict"] == "equal" and not out["model"]["shrunk"]
    assert (out["model"]["d_model"], out["model"]["vocab_size"]) == (cfg.d_model, cfg.vocab_size)
    # its own weights, not the check's random ones: the one-device loss is the model's
    from meshlm.insight import check

    run = hf_tables.with_model(RunConfig(), cfg)
    own = check.run_check(run, full=True, params=check.source_params(run, f"hf:{d}"))
    assert own.loss[1] == pytest.approx(out["loss"]["one_device"], rel=1e-6)
    assert check.run_check(run, full=True).loss[1] != pytest.approx(own.loss[1], rel=1e-3)
