"""Chat and completion data with loss masks: the render and the mask against `transformers`'
apply_chat_template (its `{% generation %}` mask as the reference for meshlm's prefix rule), packing
into rows, a packed conversation's logits equal to its own, the masked loss against a reference,
bad records, and a run on packed data."""

import dataclasses
import itertools
import json
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import tiny_config
from meshlm.config import ConfigError, DataConfig
from meshlm.data import tokenizer as toks
from meshlm.data import units as U
from meshlm.data.chat import make_format
from meshlm.data.loader import WindowLoader
from meshlm.data.prepare import fit_config_to_data, load, write_dataset
from meshlm.validation import validate

WORDS = [
    "the",
    "model",
    "answers",
    "questions",
    "about",
    "meshes",
    "shards",
    "tokens",
    "and",
    "layers",
    "with",
    "care",
    "é",
    "ü",
    "日本",
]

# The same two templates written with and without {% generation %} markers: meshlm renders the
# plain one and finds the assistant spans by prefixes; transformers' mask comes from the markers.
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endgeneration %}{% else %}{{ message['content'] + '<|im_end|>' + '\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] | trim + '<|eot_id|>' }}"
    "{% endgeneration %}{% else %}{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
MARKERS = ("{% generation %}", "{% endgeneration %}")


def plain(template: str) -> str:
    return template.replace(MARKERS[0], "").replace(MARKERS[1], "")


def conversations(n: int, seed: int = 0, longest: int = 30, turns: int = 3) -> list[list[dict]]:
    """Conversations of 1 to `turns` turns, every third with a system message; questions of 1 to 12
    words and answers of 1 to `longest` (both at most `longest` when it is below 12)."""
    rng = random.Random(seed)
    say = lambda k: " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, k)))
    out = []
    for i in range(n):
        msgs = [{"role": "system", "content": say(5)}] if i % 3 == 0 else []
        for _ in range(rng.randint(1, turns)):
            msgs += [{"role": "user", "content": say(min(12, longest))}, {"role": "assistant", "content": say(longest)}]
        out.append(msgs)
    return out


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A byte-level BPE with the templates' special tokens, tokenizer_config.json naming bos/eos."""
    root = tmp_path_factory.mktemp("chat-tokenizer")
    tok = toks.train_bpe([" ".join(c["content"] for c in m) for m in conversations(300, seed=9)], 400)
    tok.add_special_tokens(
        ["<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    )
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<|begin_of_text|>", "eos_token": "<|im_end|>"})
    )
    return root


def config48(family: str, mesh: dict | None = None, **train):
    """The tiny model at seq_len 48 (the packed rows') with this tokenizer's vocabulary."""
    cfg = tiny_config(family, mesh, **train)
    model = dataclasses.replace(cfg.model, vocab_size=448, max_seq_len=48)
    return validate(dataclasses.replace(cfg, model=model, train=dataclasses.replace(cfg.train, seq_len=48)))


def encode_records(path, tokenizer_dir, train_on="", template="", kind="chat") -> dict:
    """units.encode of one JSONL unit: each record's tokens and flags."""
    tok = toks.load(tokenizer_dir / "tokenizer.json")
    fmt = make_format(kind, train_on, tokenizer_dir / "tokenizer.json", template)
    result = U.encode(
        U.Unit("jsonl", (str(path),), nbytes=path.stat().st_size), U.TokenizerSource.of(tok), "messages", True, fmt
    )
    ends = np.cumsum(result["doc_tokens"])
    starts = np.concatenate([[0], ends[:-1]])
    return [(result["tokens"][a:b], result["flags"][a:b]) for a, b in zip(starts, ends, strict=True)], toks.eot_id(tok)


@pytest.mark.parametrize("name", ["chatml", "llama3"])
def test_render_and_mask_equal_transformers(name, tokenizer_dir, tmp_path):
    """Token for token the ids of apply_chat_template(tokenize=True), then the end-of-text id; the
    trained flags are exactly transformers' assistant mask from the {% generation %} markers (which
    meshlm never sees: it renders the template without them); `last` keeps the last assistant span,
    `all` everything but each record's first token."""
    from transformers import PreTrainedTokenizerFast

    marked = {"chatml": CHATML, "llama3": LLAMA3}[name]
    (tmp_path / "template.jinja").write_text(plain(marked))
    chats = conversations(40)
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in chats))
    hf = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_dir / "tokenizer.json"), bos_token="<|begin_of_text|>")
    hf.chat_template = marked
    docs, eot = encode_records(path, tokenizer_dir, template=str(tmp_path / "template.jinja"))
    last, _ = encode_records(path, tokenizer_dir, "last", str(tmp_path / "template.jinja"))
    everything, _ = encode_records(path, tokenizer_dir, "all", str(tmp_path / "template.jinja"))
    assert len(docs) == len(chats)
    for m, (ids, flags), (_, last_flags), (_, all_flags) in zip(chats, docs, last, everything, strict=True):
        ref = hf.apply_chat_template(m, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        np.testing.assert_array_equal(ids, [*ref["input_ids"], eot])
        mask = np.asarray([*ref["assistant_masks"], 0])
        assert mask[0] == 0 and mask.sum() > 0
        np.testing.assert_array_equal(flags & U.FLAG_TRAINED, mask)
        assert flags[0] == U.FLAG_START and not (flags[1:] & U.FLAG_START).any()
        runs = np.flatnonzero(np.diff(np.concatenate([[0], mask])) == 1)  # starts of the assistant spans
        np.testing.assert_array_equal(last_flags & U.FLAG_TRAINED, np.where(np.arange(len(mask)) >= runs[-1], mask, 0))
        np.testing.assert_array_equal(all_flags & U.FLAG_TRAINED, np.r_[0, np.ones(len(mask) - 1, int)])


def test_completion_trains_the_completion_and_its_end(tokenizer_dir, tmp_path):
    rng = random.Random(1)
    pairs = [
        (" ".join(rng.choice(WORDS) for _ in range(6)) + ":", " " + " ".join(rng.choice(WORDS) for _ in range(9)))
        for _ in range(20)
    ]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "completion": c}) + "\n" for p, c in pairs))
    docs, eot = encode_records(path, tokenizer_dir, kind="completion")
    tok = toks.load(tokenizer_dir / "tokenizer.json")
    for (prompt, completion), (ids, flags) in zip(pairs, docs, strict=True):
        trained = ids[(flags & U.FLAG_TRAINED) > 0]
        assert trained[-1] == eot
        assert tok.decode(trained[:-1].tolist()) == completion
        assert tok.decode(ids[:-1].tolist()) == prompt + completion


@pytest.fixture(scope="module")
def packed(tokenizer_dir, tmp_path_factory):
    """60 ChatML conversations, mostly short, every 10th long, packed into rows of 48 + 1 tokens."""
    root = tmp_path_factory.mktemp("packed")
    (tokenizer_dir / "chat_template.jinja").write_text(plain(CHATML))
    short, long = conversations(60, 3, longest=2, turns=1), conversations(60, 4)
    chats = [long[i] if i % 10 == 0 else short[i] for i in range(60)]
    path = root / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in chats))
    fmt = make_format("chat", "", tokenizer_dir / "tokenizer.json")
    units = [U.Unit("jsonl", (str(path),), nbytes=path.stat().st_size)]
    data = write_dataset(
        units,
        root / "data",
        field="messages",
        tokenizer=str(tokenizer_dir / "tokenizer.json"),
        fmt=fmt,
        seq_len=48,
        log=lambda _: None,
    )
    docs, eot = encode_records(path, tokenizer_dir)
    return data, docs, eot


def test_packing_keeps_records_whole_in_order(packed):
    """Rows of exactly 49 tokens; each split's records appear in order, whole, or cut to one row
    when longer (counted); padding is end-of-text tokens, one untrained document; the index's counts
    are right."""
    data, docs, eot = packed
    row = 49
    val = [d for g, d in enumerate(docs, 1) if g % 20 == 0]
    train = [d for g, d in enumerate(docs, 1) if g % 20]
    for split, records in (("train", train), ("val", val)):
        tokens = np.concatenate([np.asarray(s) for s in data.shards(split)])
        flags = np.concatenate([np.asarray(s) for s in data.flags(split)])
        assert len(tokens) % row == 0
        got, padding = [], 0
        for r in range(len(tokens) // row):
            t, f = tokens[r * row : (r + 1) * row], flags[r * row : (r + 1) * row]
            starts = [*np.flatnonzero(f & U.FLAG_START).tolist(), row]
            assert starts[0] == 0
            for a, b in itertools.pairwise(starts):
                got.append((t[a:b], f[a:b]))
        # the padding documents: end-of-text only, never trained, last in their row
        pads = [g for g in got if (g[0] == eot).all() and not (g[1] & U.FLAG_TRAINED).any()]
        got = [g for g in got if not any(g is p for p in pads)]
        padding = sum(len(p[0]) for p in pads)
        assert len(got) == len(records)
        truncated = 0
        for (t, f), (want_t, want_f) in zip(got, records, strict=True):
            truncated += len(want_t) > row
            np.testing.assert_array_equal(t, want_t[:row])
            np.testing.assert_array_equal(f, want_f[:row])
        stats = data.packed[split]
        assert (stats["records"], stats["truncated"], stats["padding"]) == (len(records), truncated, padding)
        assert stats["trained"] == int((flags & U.FLAG_TRAINED).sum())
    assert data.packed["train"]["truncated"] > 0


def test_two_processes_and_small_units_give_the_same_bytes(packed, tokenizer_dir, tmp_path):
    """Chat records cut into several work units and encoded in two spawned processes: the same shards,
    flags and digests as one process (flags travel through the work units like the tokens)."""
    data, _, _ = packed
    path = data.root.parent / "chats.jsonl"
    units = U.plan([path], unit_bytes=1500)
    assert len(units) > 2
    fmt = make_format("chat", "", tokenizer_dir / "tokenizer.json")
    tok = str(tokenizer_dir / "tokenizer.json")
    other = write_dataset(
        units, tmp_path / "two", field="messages", tokenizer=tok, fmt=fmt, seq_len=48, processes=2, log=lambda _: None
    )
    assert other.meta["splits"] == data.meta["splits"] and other.meta["packed"] == data.meta["packed"]
    flags = other.root / other.meta["splits"]["train"][0]["flags"]  # a flipped mask bit is caught
    raw = bytearray(flags.read_bytes())
    raw[5] ^= U.FLAG_TRAINED
    flags.write_bytes(bytes(raw))
    with pytest.raises(ConfigError, match=r"is corrupt .*BLAKE2b"):
        other.verify(448)


def test_the_loader_gives_masks_and_a_packed_row_the_logits_it_gets_alone(packed):
    """The loader's mask is each target's trained flag and its segments restart at each record; a
    record in a packed row (gpt: learned positions, indexed by the restarted positions) gets exactly
    the logits it gets alone."""
    from meshlm.model.params import init_params, param_specs
    from meshlm.model.transformer import forward

    data, _, _ = packed
    loader = WindowLoader(data.shards("train"), 48, 4, 0, flags=data.flags("train"))
    batch = loader.batch(0)
    flags = np.stack([np.asarray(loader._window(int(w)))[1] for w in loader.window_ids(0)])
    np.testing.assert_array_equal(batch["mask"], flags[:, 1:] & 1)
    model = dataclasses.replace(config48("gpt").model, dropout=0.0)
    params = init_params(param_specs(model), jax.random.key(0))
    run = jax.jit(lambda x, s, p: forward(params, x, model, None, segment_ids=s, positions=p))
    whole = np.asarray(run(batch["inputs"], batch["segment_ids"], batch["positions"]))
    row = int(np.argmax([len(set(s)) for s in batch["segment_ids"]]))  # the row with most records
    seg = batch["segment_ids"][row]
    assert len(set(seg)) >= 2
    for s in set(seg.tolist()):
        (at,) = np.nonzero(seg == s)
        alone = np.asarray(run(batch["inputs"][row : row + 1, at], None, None))[0]
        np.testing.assert_allclose(whole[row, at], alone, atol=2e-5)


def test_masked_loss_and_gradients_against_a_reference():
    """One device: the step's loss is the trained tokens' mean negative log-likelihood in float64
    NumPy from the model's logits (the global convention: summed over the batch's trained tokens,
    divided by their count), and its raw gradients are those of a hand-written masked loss."""
    import optax

    from helpers import loss_mask, random_batches
    from meshlm.model.params import init_params, param_specs
    from meshlm.model.transformer import forward
    from meshlm.parallel.mesh import make_layout
    from meshlm.step import make_grad_step
    from meshlm.train_state import state_shardings

    cfg = tiny_config("llama", microbatches=2)
    batch = random_batches(cfg, 1, seed=5)[0] | {"mask": loss_mask((8, 32))}
    layout = make_layout(cfg.parallel, jax.devices()[:1])
    shardings = state_shardings(param_specs(cfg.model), layout, optax.sgd(1.0)).params
    params = init_params(param_specs(cfg.model), jax.random.key(1))
    got = jax.device_get(make_grad_step(cfg, layout, shardings)(params, batch, 0))
    logits = np.asarray(forward(params, batch["inputs"], cfg.model, None), np.float64)
    logp = (
        logits
        - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
        - logits.max(-1, keepdims=True)
    )
    nll = -np.take_along_axis(logp, batch["targets"][..., None], -1)[..., 0]
    m = batch["mask"]
    np.testing.assert_allclose(got["loss"], (nll * m).sum() / m.sum(), rtol=1e-5)

    def masked(p):
        lp = jax.nn.log_softmax(forward(p, batch["inputs"], cfg.model, None).astype(jnp.float32))
        picked = jnp.take_along_axis(lp, batch["targets"][..., None], -1)[..., 0]
        return -(picked * m).sum() / m.sum()

    want = jax.device_get(jax.grad(masked)(params))
    for a, b in zip(jax.tree.leaves(got["grads"]), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, atol=2e-6, rtol=1e-4)


def test_bad_records_are_counted_or_named(tokenizer_dir, tmp_path):
    lines = [
        json.dumps({"messages": conversations(1)[0]}),
        "{not json",
        json.dumps({"text": "no messages"}),
        json.dumps({"messages": [{"role": "user", "content": "no answer"}]}),
        json.dumps({"messages": [{"role": "user", "content": 3}]}),
        json.dumps({"messages": conversations(2)[1]}),
    ]
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    tok = str(tokenizer_dir / "tokenizer.json")
    (tokenizer_dir / "chat_template.jinja").write_text(plain(CHATML))
    fmt = make_format("chat", "", tok)
    units = [U.Unit("jsonl", (str(path),), nbytes=path.stat().st_size)]
    with pytest.raises(ConfigError, match=r"bad\.jsonl:2: not valid JSON"):
        write_dataset(
            units, tmp_path / "strict", field="messages", tokenizer=tok, fmt=fmt, seq_len=32, log=lambda _: None
        )
    data = write_dataset(
        units,
        tmp_path / "skip",
        field="messages",
        tokenizer=tok,
        fmt=fmt,
        seq_len=32,
        on_error="skip",
        log=lambda _: None,
    )
    assert data.meta["skipped"] == {"not_json": 1, "no_field": 1, "bad_record": 2}
    assert any("no assistant message" in e for e in data.meta["skipped_examples"])
    # a template that rewrites earlier turns (drops past assistant content) cannot be cut by prefixes
    (tmp_path / "rewrites.jinja").write_text(
        "{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}{{ m['content'] }}{% endif %}{% endfor %}"
    )
    two_turns = tmp_path / "two.jsonl"
    two_turns.write_text(json.dumps({"messages": conversations(4)[3]}) + "\n")
    with pytest.raises(ConfigError, match="rewrites earlier turns"):
        encode_records(two_turns, tokenizer_dir, template=str(tmp_path / "rewrites.jinja"))
    with pytest.raises(ConfigError, match="--seq-len"):
        write_dataset(units, tmp_path / "x", field="messages", tokenizer=tok, fmt=fmt, log=lambda _: None)


def test_training_on_packed_data_masks_the_loss(packed, tmp_path, capsys):
    """`meshlm train` on a packed dataset turns on the loss and document masks itself (read from the
    index before compiling), refuses another seq_len, and trains; `meshlm eval` of the packed split
    scores its trained tokens."""
    from meshlm.trainer import train

    data, _, _ = packed
    cfg = tiny_config("llama", dict(data=2), steps=2, log_every=1, eval_every=2, seq_len=48)
    cfg = dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, vocab_size=448, max_seq_len=48),
        data=DataConfig(paths=(str(data.root),)),
    )
    fitted = fit_config_to_data(validate(cfg), log=lambda _: None)
    assert fitted.data.loss_mask and fitted.data.document_mask
    with pytest.raises(ConfigError, match=r"set train\.seq_len to it"):
        fit_config_to_data(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, seq_len=32)))
    with pytest.raises(ConfigError, match="needs data prepared with --format chat"):
        fit_config_to_data(dataclasses.replace(cfg, data=DataConfig(loss_mask=True)))
    result = train(validate(cfg), tmp_path / "run", quiet=True)
    assert np.isfinite(result.val_loss)
    saved = json.loads((tmp_path / "run" / "config.json").read_text())["data"]
    assert saved["loss_mask"] and saved["document_mask"]
    assert load(data.root).meta["format"] == 4
    # meshlm eval on the packed split counts exactly its trained tokens
    from meshlm.cli import main

    assert main(["eval", "--run-dir", str(tmp_path / "run"), "--data", str(data.root), "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["tokens"] == data.packed["val"]["trained"] and np.isfinite(out["loss"])
