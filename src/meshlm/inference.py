"""Using a trained model: load a run's weights onto a mesh, generate text with a KV cache, and
evaluate loss / perplexity / bits per byte.

Generation: prompts of different lengths are left-padded into one batch, so every row writes its
next token to the same cache slot. A preallocated cache ([L, b, S, kv heads, head_dim] for K and
for V, S = prompt + new tokens rounded up to 16) is filled by one jitted prefill over the prompts,
then one jitted decode step per token reads it and writes one slot; both run on the run's mesh
layout (tensor-parallel decode: the cache is sharded over kv heads like the activations). Sampling
(greedy, temperature, top-k, top-p) runs inside the step; the key of step i is fold_in(seed, i),
so a seed reproduces its tokens.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from meshlm import axes as ax
from meshlm.config import ConfigError, ParallelConfig, RunConfig, from_dict
from meshlm.data import tokenizer as toks
from meshlm.model import mla
from meshlm.model.moe import without_capacity
from meshlm.model.params import abstract_params, param_specs
from meshlm.model.transformer import CACHE_AXES, KVCache, forward
from meshlm.parallel.mesh import make_layout
from meshlm.parallel.rules import Layout
from meshlm.train_state import param_shardings
from meshlm.validation import validate

BUCKET = 16  # prompt and cache lengths are rounded up to this, so nearby lengths share a compile


@dataclass
class Model:
    """A model ready to run: config, parameters on a layout, and its tokenizer (if known)."""

    cfg: RunConfig
    params: dict
    layout: Layout
    tokenizer: object | None = None  # tokenizers.Tokenizer
    eos_id: int | None = None  # the end-of-text token (also the padding of left-padded prompts)
    source: str = ""
    stop_ids: tuple[int, ...] = ()  # tokens that end a row (default: eos_id)
    root: Path | None = None  # the run or Hugging Face directory it was loaded from
    meta: dict = dataclasses.field(default_factory=dict)  # a run's: its checkpoint step's meta item

    @property
    def stops(self) -> tuple[int, ...]:
        return self.stop_ids or (() if self.eos_id is None else (self.eos_id,))

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ConfigError(f"{self.source} has no tokenizer.json; pass token ids instead of text")
        return self.tokenizer.encode(text).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids))


def _inference_config(cfg: RunConfig, parallel: ParallelConfig | None) -> RunConfig:
    """The run's config on the inference mesh (default: one device), checked for divisibility."""
    parallel = parallel or ParallelConfig()
    if parallel.context > 1:
        raise ConfigError(
            "generation and evaluation do not split the sequence over 'context'; use data, fsdp or tensor "
            "(a model trained with context parallelism loads on any mesh)"
        )
    if parallel.stage > 1:
        raise ConfigError(
            "generation and evaluation do not run a pipeline over 'stage'; use data, fsdp or tensor "
            "(a model trained with pipeline parallelism loads on any mesh)"
        )
    seq_len = cfg.train.seq_len if cfg.model.family != "gpt" else min(cfg.train.seq_len, cfg.model.max_seq_len)
    train = dataclasses.replace(cfg.train, global_batch=parallel.batch_shards, microbatches=1, seq_len=seq_len)
    parallel = dataclasses.replace(parallel, sequence_parallel=False)
    return validate(dataclasses.replace(cfg, parallel=parallel, train=train))


def run_tokenizer_file(run_dir: Path) -> Path | None:
    """A run's tokenizer file: <run_dir>/tokenizer.json (written by `meshlm train` and `convert`),
    else the one of the prepared data its run.json names; None when neither exists."""
    if (run_dir / "tokenizer.json").is_file():
        return run_dir / "tokenizer.json"
    info = run_dir / "run.json"
    if info.is_file():
        root = json.loads(info.read_text()).get("data_root")
        if root and (Path(root) / "tokenizer.json").is_file():
            return Path(root) / "tokenizer.json"
    return None


def load_model(
    run_dir: str | Path,
    step: int | None = None,
    parallel: ParallelConfig | None = None,
    dtype: str | None = None,
    base: bool = True,
) -> Model:
    """A meshlm run directory's weights (latest good checkpoint, or `step`) on a mesh, or a
    Hugging Face directory's when `run_dir` is "hf:DIR". A LoRA run's adapters come on their
    frozen base, or (`base=False`: a PEFT export) alone, the base not read."""
    from meshlm.interop import hf, hf_tables

    if hf.is_hf_ref(str(run_dir)):
        root = hf.hf_path(str(run_dir))
        model_cfg = hf_tables.model_config(root)
        train = dataclasses.replace(RunConfig().train, seq_len=min(1024, model_cfg.max_seq_len))
        cfg = _inference_config(RunConfig(model=model_cfg, train=train), parallel)
        if dtype:
            cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dtype=dtype))
        layout = make_layout(cfg.parallel)
        params = hf.load_params(root, cfg.model, param_shardings(param_specs(cfg.model), layout))
        tok = toks.load(root / "tokenizer.json") if (root / "tokenizer.json").is_file() else None
        stops = hf.token_ids(root)["eos_token_id"]
        eos = stops[0] if stops else _eos(tok)
        return Model(cfg, params, layout, tok, eos, str(run_dir), tuple(stops), root)
    from meshlm.checkpoint import Checkpointer, resolve_checkpoint

    root = Path(run_dir).expanduser()
    if not (root / "config.json").is_file():
        raise ConfigError(f"{root} is not a meshlm run directory (no config.json); for Hugging Face use hf:{root}")
    cfg = _inference_config(from_dict(json.loads((root / "config.json").read_text())), parallel)
    if dtype:
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dtype=dtype))
    layout = make_layout(cfg.parallel)
    specs = param_specs(cfg.model)
    directory, _ = resolve_checkpoint(root, "--run-dir")
    shardings = param_shardings(specs, layout)
    abstract = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_params(specs), shardings
    )
    ckpt = Checkpointer(directory, cfg.checkpoint, log=lambda m: None, read_only=True)
    try:
        params, meta = ckpt.restore_params(abstract, step)
    finally:
        ckpt.close()
    if base:
        from meshlm.sources import with_base

        params = with_base(params, meta, cfg, abstract)  # a LoRA run's adapters on their base
    tok_file = run_tokenizer_file(root)
    tok = None if tok_file is None else toks.load(tok_file)
    if tok is not None and meta.get("tokenizer_fingerprint") not in (None, toks.fingerprint(tok)):
        raise ConfigError(f"{root}'s tokenizer.json is not the tokenizer its checkpoint was trained with")
    stops = hf.token_ids(root)["eos_token_id"] if (root / "generation_config.json").is_file() else []
    eos = _eos(tok)
    eos = stops[0] if eos is None and stops else eos
    return Model(cfg, params, layout, tok, eos, f"{directory}/{meta['step']}", tuple(stops), root, meta)


def _eos(tok) -> int | None:
    if tok is None:
        return None
    try:
        return toks.eot_id(tok)
    except ConfigError:
        return None


# ------------------------------------------------------------------------------------- sampling


def sample(logits_bv: jax.Array, key: jax.Array, temperature: float, top_k: int, top_p: float) -> jax.Array:
    """Next tokens [b] from fp32 logits: greedy when temperature == 0; else softmax(logits / T)
    restricted to the top_k most likely tokens (0: all) and to the smallest set whose probability
    reaches top_p (1: all)."""
    if temperature == 0:
        return jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)
    x = logits_bv / temperature
    if top_k:
        kth = jax.lax.top_k(x, top_k)[0][:, -1:]
        x = jnp.where(x < kth, -jnp.inf, x)
    if top_p < 1.0:
        sorted_desc = -jnp.sort(-x, axis=-1)
        probs = jax.nn.softmax(sorted_desc, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass of the more likely tokens
        keep = before < top_p  # the most likely token always stays
        threshold = jnp.min(jnp.where(keep, sorted_desc, jnp.inf), axis=-1, keepdims=True)
        x = jnp.where(x < threshold, -jnp.inf, x)
    return jax.random.categorical(key, x, axis=-1).astype(jnp.int32)


@dataclass
class Generation:
    tokens: list[list[int]]  # new tokens per prompt (ending with the end-of-text token if one was drawn)
    logits: np.ndarray | None  # [b, steps, vocab] fp32: the logits each new token was drawn from
    prefill_s: float  # the prompt's forward pass and the first token (compiles on a new shape)
    first_decode_s: float  # the first decode step alone (compiles on a new shape; 0 if none ran)
    decode_s: float  # every later decode step: the steady rate is decode_steps / decode_s
    decode_steps: int


class Generator:
    """Jitted prefill and decode for one model on its layout (compiled once per shape bucket and
    sampling setting; reuse one Generator for many calls)."""

    def __init__(self, model: Model):
        self.model = model
        m, layout = model.cfg.model, model.layout
        self.batch_shards = model.cfg.parallel.batch_shards
        self._cache_sharding = layout.sharding(mla.CACHE_AXES if m.mla else CACHE_AXES)
        tokens_sh = layout.sharding((ax.BATCH, None))
        self._row_sh = layout.sharding((ax.BATCH,))
        params_sh = param_shardings(param_specs(m), layout)
        n_valid = m.vocab_size
        if model.tokenizer is not None:  # ids past the tokenizer's largest are never drawn
            n_valid = min(m.vocab_size, max(model.tokenizer.get_vocab(with_added_tokens=True).values()) + 1)
        self.n_valid = n_valid
        cache_sh = KVCache(self._cache_sharding, self._cache_sharding, layout.replicated(), self._row_sh)

        def run(params, tokens_bt, cache, key, temperature, top_k, top_p, prefill):
            # MoE: dropless (a decode step is a capacity group of one token; a prefill's padding would take slots)
            logits, cache = forward(params, tokens_bt, without_capacity(m), layout, cache=cache, prefill=prefill)
            last = logits[:, -1]
            if n_valid < m.vocab_size:
                last = jnp.where(jnp.arange(m.vocab_size) < n_valid, last, -jnp.inf)
            return sample(last, key, temperature, top_k, top_p), last, cache

        self._run, self._steps, self._zeros = run, {}, {}
        self._jit = partial(
            jax.jit,
            in_shardings=(params_sh, tokens_sh, cache_sh, None),
            out_shardings=(self._row_sh, layout.sharding((ax.BATCH, ax.ACT_VOCAB)), cache_sh),
            donate_argnums=(2,),
        )

    def _step(self, params, tokens, cache, key, **opts):
        """The jitted prefill/decode step for these sampling options (one compile per shape)."""
        name = tuple(sorted(opts.items()))
        if name not in self._steps:
            self._steps[name] = self._jit(partial(self._run, **opts))
        return self._steps[name](params, tokens, cache, key)

    def _empty_cache(self, b: int, s: int, start: np.ndarray) -> KVCache:
        m = self.model.cfg.model
        shapes = tuple((m.n_layers, b, s, *rows) for rows in mla.cache_rows(m))  # MLA: the latent cache
        if shapes not in self._zeros:
            self._zeros[shapes] = jax.jit(
                lambda: tuple(jnp.zeros(shape, jnp.dtype(m.dtype)) for shape in shapes),
                out_shardings=(self._cache_sharding, self._cache_sharding),
            )
        k, v = self._zeros[shapes]()
        start = jax.device_put(start.astype(np.int32), self._row_sh)
        return KVCache(k, v, jnp.zeros((), jnp.int32), start)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int = 64,
        *,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
        stop_at_eos: bool = True,
        return_logits: bool = False,
        on_token: Callable[[list[list[int]]], None] | None = None,
    ) -> Generation:
        """New tokens for each prompt (token ids). A row ends at its first stop token (the model's
        end-of-text ids) unless `stop_at_eos` is off; `on_token(tokens so far)` after each step."""
        self._check(prompts, max_new_tokens, temperature, top_k, top_p)
        top_k = min(top_k, self.n_valid)
        n = len(prompts)
        tokens, start, s_len = self._left_padded(prompts, max_new_tokens)
        cache = self._empty_cache(tokens.shape[0], s_len, start)
        key = jax.random.key(seed)
        opts = dict(temperature=float(temperature), top_k=int(top_k), top_p=float(top_p))
        t0 = time.perf_counter()
        tok, logits, cache = self._step(
            self.model.params, tokens, cache, jax.random.fold_in(key, 0), prefill=True, **opts
        )
        out_tok, out_logits = [tok], [logits] if return_logits else []
        jax.block_until_ready(tok)
        prefill_s = time.perf_counter() - t0
        stops = np.asarray(self.model.stops if stop_at_eos else (), np.int32)
        done = np.zeros((n,), bool)
        seen = 0  # tokens already checked for stops
        times = []  # wall clock after each decode step's dispatch (the first one waits for its compile)
        t0 = time.perf_counter()
        for i in range(1, max_new_tokens):
            if on_token is not None or i % 8 == 0:  # each check covers every token since the last
                new = np.stack([np.asarray(t) for t in out_tok[seen:]], 1)[:n]
                seen = len(out_tok)
                done |= np.isin(new, stops).any(axis=1)
                if on_token is not None:
                    on_token(_trim(np.stack([np.asarray(t) for t in out_tok], 1)[:n], stops))
                if done.all():
                    break
            tok, logits, cache = self._step(
                self.model.params, tok[:, None], cache, jax.random.fold_in(key, i), prefill=False, **opts
            )
            if i == 1:  # the first decode step compiles the decode program on a new shape: timed apart
                jax.block_until_ready(tok)
            times.append(time.perf_counter())
            out_tok.append(tok)
            if return_logits:
                out_logits.append(logits)
        all_tok = np.stack([np.asarray(t) for t in out_tok], 1)[:n]
        end = time.perf_counter()
        result = _trim(all_tok, stops)
        if on_token is not None:
            on_token(result)
        lg = np.stack([np.asarray(x) for x in out_logits], 1)[:n] if return_logits else None
        first = times[0] - t0 if times else 0.0
        steady = end - times[0] if times else 0.0
        return Generation(result, lg, prefill_s, first, steady, max(0, len(out_tok) - 2))

    def _check(self, prompts, max_new_tokens: int, temperature: float, top_k: int, top_p: float) -> None:
        m = self.model.cfg.model
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ConfigError("every prompt needs at least one token")
        if max_new_tokens < 1 or temperature < 0 or top_k < 0 or not 0 < top_p <= 1:
            raise ConfigError("need max_new_tokens >= 1, temperature >= 0, top_k >= 0 and 0 < top_p <= 1")
        longest = max(len(p) for p in prompts)
        if m.family == "gpt" and longest + max_new_tokens > m.max_seq_len:
            raise ConfigError(
                f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's "
                f"{m.max_seq_len} positions"
            )
        bad = [t for p in prompts for t in p if not 0 <= t < m.vocab_size]
        if bad:
            raise ConfigError(f"token id {bad[0]} is outside the vocabulary (0..{m.vocab_size - 1})")

    def _left_padded(self, prompts, max_new_tokens: int) -> tuple[np.ndarray, np.ndarray, int]:
        """(tokens [b, p_len], each row's first real position, cache length): the prompts
        left-padded to a bucket, the rows padded to the batch shards."""
        n, longest = len(prompts), max(len(p) for p in prompts)
        b = -(-n // self.batch_shards) * self.batch_shards
        p_len = -(-longest // BUCKET) * BUCKET
        s_len = -(-(p_len + max_new_tokens) // BUCKET) * BUCKET
        pad = 0 if self.model.eos_id is None else self.model.eos_id
        rows = [list(p) for p in prompts] + [[pad]] * (b - n)
        tokens = np.full((b, p_len), pad, np.int32)
        start = np.zeros((b,), np.int32)
        for r, p in enumerate(rows):
            tokens[r, p_len - len(p) :] = p
            start[r] = p_len - len(p)
        return tokens, start, s_len


def _trim(tokens_bt: np.ndarray, stops: np.ndarray) -> list[list[int]]:
    """Each row up to and including its first stop token."""
    out = []
    for row in tokens_bt.tolist():
        hits = [j for j, t in enumerate(row) if t in stops]
        out.append(row[: hits[0] + 1] if hits else row)
    return out


def generate(
    run_dir: str | Path,
    prompts: Sequence[str] | str,
    max_new_tokens: int = 64,
    *,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    step: int | None = None,
    parallel: ParallelConfig | None = None,
    on_text: Callable[[str], None] | None = None,
) -> list[str] | str:
    """Text continuations of `prompts` by the model of a run directory (or "hf:DIR"). Greedy by
    default. `on_text(piece)` streams the new text of a single prompt as it is generated. Loads
    the model on every call: for many calls, keep `Generator(load_model(...))`."""
    model = load_model(run_dir, step, parallel)
    single = isinstance(prompts, str)
    texts = [prompts] if single else list(prompts)
    stream = None
    if on_text is not None:
        if not single:
            raise ConfigError("on_text streams one prompt; pass a single string")
        stream = TextStream(model, on_text)
    out = Generator(model).generate(
        [model.encode(t) for t in texts],
        max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        on_token=stream,
    )
    decoded = [model.decode(t) for t in out.tokens]
    return decoded[0] if single else decoded


class TextStream:
    """An `on_token` callback that passes the new text of row 0 to `emit`, holding back a trailing
    incomplete UTF-8 character."""

    def __init__(self, model: Model, emit: Callable[[str], None]):
        self.model, self.emit, self.shown = model, emit, ""

    def __call__(self, tokens: list[list[int]]) -> None:
        text = self.model.decode(tokens[0])
        if len(text) > len(self.shown) and not text.endswith("\ufffd"):
            self.emit(text[len(self.shown) :])
            self.shown = text


# ------------------------------------------------------------------------------------ evaluation


def _text_tokens(model: Model, paths: Sequence[str], field: str) -> np.ndarray:
    from meshlm.data import corpus

    eos = toks.eot_id(model.tokenizer)
    ids: list[int] = []
    for doc in corpus.iter_documents(corpus.resolve_files(list(paths)), field):
        ids += [*model.tokenizer.encode(doc).ids, eos]
    return np.asarray(ids, np.int32)


def eval_tokens(
    model: Model, data: Sequence[str] = (), split: str = "val", run_dir: Path | None = None, field: str = "text"
) -> tuple[np.ndarray, str]:
    """The token stream to evaluate and a description: a prepared dataset's split (default: the
    run's own data), or raw text files tokenized with the model's tokenizer. A packed chat /
    completion dataset is returned itself (a `PreparedData`), for `evaluate_packed`."""
    from meshlm.data.prepare import is_prepared, load

    if model.tokenizer is None:
        raise ConfigError(f"{model.source} has no tokenizer; evaluation needs one to count bytes")
    if not data and run_dir is not None and (run_dir / "run.json").is_file():
        info = json.loads((run_dir / "run.json").read_text())
        sources = [p["root"] for p in info.get("data", {}).get("mixture", [])]
        if sources:  # one split of several sources: which one is the user's question
            raise ConfigError(
                f"{run_dir} trained on a data.mixture; pass --data with one of its sources: {', '.join(sources)}"
            )
        data = [info["data_root"]] if info.get("data_root") else []
    if not data:
        raise ConfigError("no data to evaluate: pass --data (a prepared dataset or text files)")
    if len(data) == 1 and is_prepared(data[0]):
        prepared = load(data[0])
        if prepared.meta["tokenizer_fingerprint"] != toks.fingerprint(model.tokenizer):
            raise ConfigError(
                f"{data[0]} was prepared with another tokenizer than the model's; its ids mean other tokens"
            )
        if split not in prepared.meta["splits"]:
            raise ConfigError(f"split {split!r} not in {data[0]} (splits: train, val)")
        if prepared.packed:  # rows of chat / completion records: `evaluate_packed`
            return prepared, f"{prepared.root} ({split}, {prepared.packed['format']} rows, trained tokens)"
        return prepared.tokens(split), f"{prepared.root} ({split})"  # memory-mapped (one shard)
    return _text_tokens(model, data, field), ", ".join(data)


def evaluate_packed(model: Model, data, split: str = "val", batch_size: int = 8, max_tokens: int = 0) -> dict:
    """Loss, perplexity and bits per byte of a packed chat / completion split (`meshlm data prepare
    --format chat`), row by row in order, over its trained tokens only (the loss mask the run
    trained with), each record attending within itself. Bytes: the trained tokens decoded row by row."""
    from meshlm.data.loader import WindowLoader
    from meshlm.step import batch_sharding, make_eval_step

    cfg = model.cfg
    seq_len = data.packed["seq_len"]
    b = -(-batch_size // cfg.parallel.batch_shards) * cfg.parallel.batch_shards
    rows = WindowLoader(data.shards(split), seq_len, b, 0, split, flags=data.flags(split))
    step = make_eval_step(cfg, model.layout, param_shardings(param_specs(cfg.model), model.layout))
    sharding = batch_sharding(model.layout)
    total = count = 0.0
    n_bytes = 0
    for j in range(math.ceil(rows.n_windows / b)):
        ids = [min(j * b + r, rows.n_windows - 1) for r in range(b)]
        batch = rows.rows([rows._window(i) for i in ids])
        batch["mask"][[r for r in range(b) if j * b + r >= rows.n_windows]] = 0  # the last batch's filler rows
        loss_sum, c = step(model.params, jax.device_put(batch, sharding))
        total, count = total + float(loss_sum), count + float(c)
        for t, m in zip(batch["targets"], batch["mask"], strict=True):
            n_bytes += len(model.decode(t[m > 0].tolist()).encode("utf-8"))
        if max_tokens and count >= max_tokens:
            break
    if not count:
        raise ConfigError(f"{data.root} ({split}) has no trained tokens to evaluate")
    return _scores(total, count, n_bytes)


def _scores(total: float, count: float, n_bytes: int) -> dict:
    """Loss, perplexity and bits per byte of `count` tokens whose losses sum to `total` nats."""
    loss = total / count
    return {
        "tokens": int(count),
        "bytes": n_bytes,
        "loss": loss,
        "perplexity": math.exp(min(loss, 700.0)),
        "bits_per_byte": total / math.log(2) / n_bytes if n_bytes else None,
        "bytes_per_token": n_bytes / count,
    }


def evaluate(
    model: Model,
    tokens: np.ndarray,
    seq_len: int,
    batch_size: int = 8,
    max_tokens: int = 0,
    progress: Callable[[int, int], None] | None = None,
) -> dict:
    """Loss (nats/token), perplexity and bits per byte over consecutive windows of `tokens`.

    Every token but the first is predicted exactly once (windows of seq_len + 1 overlapping by
    one). Bytes are those of the predicted tokens decoded in order (end-of-text tokens predicted
    but contributing no text), so bits/byte = total nats / ln 2 / bytes."""
    from meshlm.data.loader import document_segments
    from meshlm.step import batch_sharding, make_eval_step

    cfg = model.cfg
    if cfg.model.family == "gpt" and seq_len > cfg.model.max_seq_len:
        raise ConfigError(f"seq_len {seq_len} exceeds the model's {cfg.model.max_seq_len} positions")
    if max_tokens:
        tokens = tokens[: max_tokens + 1]
    n_windows = math.ceil((len(tokens) - 1) / seq_len)
    if n_windows < 1:
        raise ConfigError("fewer than 2 tokens to evaluate")
    b = -(-batch_size // cfg.parallel.batch_shards) * cfg.parallel.batch_shards
    step = make_eval_step(cfg, model.layout, param_shardings(param_specs(cfg.model), model.layout))
    sharding = batch_sharding(model.layout)
    eot = toks.eot_id(model.tokenizer) if cfg.data.document_mask else None
    total = count = 0.0
    n_batches = math.ceil(n_windows / b)
    for j in range(n_batches):
        batch = {k: np.zeros((b, seq_len), np.int32) for k in ("inputs", "targets")}
        mask = np.zeros((b, seq_len), np.float32)
        for r in range(b):
            w = j * b + r
            if w >= n_windows:
                break
            piece = np.asarray(tokens[w * seq_len : w * seq_len + seq_len + 1], np.int32)
            k = len(piece) - 1
            batch["inputs"][r, :k], batch["targets"][r, :k], mask[r, :k] = piece[:-1], piece[1:], 1.0
        batch["mask"] = mask
        if eot is not None:
            batch |= document_segments(batch["inputs"], eot)
        loss_sum, c = step(model.params, jax.device_put(batch, sharding))
        total, count = total + float(loss_sum), count + float(c)
        if progress is not None:
            progress(j + 1, n_batches)
    # Bytes document by document (split after each end-of-text token, which decodes to nothing), so
    # a large split is never decoded as one string.
    predicted = np.asarray(tokens[1 : 1 + int(count)])
    cuts = np.flatnonzero(predicted == toks.eot_id(model.tokenizer)) + 1
    n_bytes = sum(len(model.decode(doc.tolist()).encode("utf-8")) for doc in np.split(predicted, cuts) if len(doc))
    return _scores(total, count, n_bytes)
