"""lm-evaluation-harness on meshlm: `meshlm eval --tasks T1,T2` scores a run directory or `hf:DIR`
on any mesh through `lm_eval`'s model interface (`MeshLM`, a `TemplateLM`).

Requests are answered as `lm_eval`'s own Hugging Face backend answers them, so the numbers are
comparable with it: the same context/continuation split (`TemplateLM._encode_pair`: trailing
spaces of the context move to the continuation, the pair is encoded whole), the same prefix token
for an empty context (the tokenizer's BOS if it has one, else end-of-text), the same rolling
windows for perplexity tasks (`lm_eval.utils.get_rolling_token_windows`, context 1), inputs
left-truncated to the model's length. Scores are computed on the devices: each row's target
log-probabilities and whether each target was the argmax come back, never the logits.

Tasks come from lm_eval's registry or from local YAML and data files (`--include-path`): this
machine has no hub access, and a registry task whose dataset lives on the hub fails to load.
Needs the `eval` extra: pip install 'meshlm[eval]'.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from meshlm.config import ConfigError

BUCKETS = (32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)  # padded lengths (one compile each)


def _lm_eval():
    try:
        import lm_eval  # noqa: F401
        from lm_eval.api.model import TemplateLM
    except ImportError:
        raise ConfigError("meshlm eval --tasks needs lm-evaluation-harness: pip install 'meshlm[eval]'") from None
    return TemplateLM


def make_lm(model, batch_size: int = 8, max_gen_toks: int = 256):
    """A `lm_eval` model answering with `model` (`inference.Model`, on its mesh)."""
    TemplateLM = _lm_eval()

    class MeshLM(TemplateLM):
        def __init__(self):
            super().__init__()
            if model.tokenizer is None:
                raise ConfigError(f"{model.source} has no tokenizer.json; lm-eval tasks are text")
            self.model, self.batch_size, self.max_gen_toks = model, batch_size, max_gen_toks
            self._score = _scorer(model)
            self._special = _special_ids(model)

        @property
        def eot_token_id(self) -> int:
            return self._special.get("eos_token", model.eos_id)

        @property
        def prefix_token_id(self) -> int:
            return self._special.get("bos_token", self.eot_token_id)

        @property
        def max_length(self) -> int:
            return model.cfg.model.max_seq_len

        def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
            return model.tokenizer.encode(string, add_special_tokens=bool(add_special_tokens)).ids

        def tok_decode(self, tokens: Sequence[int], **kwargs) -> str:
            return model.decode(tokens)

        def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
            rows = []
            for _, context_enc, continuation_enc in requests:
                whole = (list(context_enc) + list(continuation_enc))[-(self.max_length + 1) :]
                rows.append((whole, len(continuation_enc)))
            return self._score(rows, self.batch_size)

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
            from lm_eval import utils

            out = []
            for (string,) in [r.args for r in requests]:
                windows = map(
                    utils.make_disjoint_window,
                    utils.get_rolling_token_windows(
                        token_list=self.tok_encode(string),
                        prefix_token=self.prefix_token_id,
                        max_seq_len=self.max_length,
                        context_len=1,
                    ),
                )
                scores = self._loglikelihood_tokens([(None, c, t) for c, t in windows])
                out.append(sum(s for s, _ in scores))
            return out

        def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
            from meshlm.inference import Generator

            generator = Generator(model)
            out = []
            for context, kwargs in [r.args for r in requests]:
                kwargs = dict(kwargs)
                until = kwargs.pop("until", None) or []
                until = [until] if isinstance(until, str) else list(until)
                n = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
                if kwargs.get("do_sample") and float(kwargs.get("temperature", 1.0)) > 0:
                    raise ConfigError("meshlm eval --tasks generates greedily; this task asks for sampling")
                prompt = self.tok_encode(context)[-(self.max_length - n) :]
                tokens = generator.generate([prompt], n, temperature=0.0).tokens[0]
                text = model.decode(tokens)
                for stop in until:
                    text = text.split(stop)[0] if stop else text
                out.append(text)
            return out

    return MeshLM()


def _special_ids(model) -> dict[str, int]:
    """The tokenizer's BOS and EOS ids as `transformers` reads them (the tokenizer_config.json of
    an hf:DIR model, or the one a run kept from the model it started from), which lm_eval's Hugging
    Face backend uses for an empty context's prefix."""
    from meshlm.interop.hf_tables import read_json

    if model.root is None:
        return {}
    path = model.root / "tokenizer_config.json"
    config = read_json(path) if path.is_file() else {}
    out = {}
    for name in ("bos_token", "eos_token"):
        value = config.get(name)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str) and model.tokenizer.token_to_id(value) is not None:
            out[name] = model.tokenizer.token_to_id(value)
    return out


def _scorer(model):
    """`score(rows, batch_size)`: for each (tokens, n) the sum of the log-probabilities of the last n
    tokens given the ones before, and whether each was the argmax; rows padded to a bucket length."""
    from meshlm.model.transformer import forward
    from meshlm.step import batch_sharding

    cfg, layout = model.cfg, model.layout
    sharding = batch_sharding(layout)

    @jax.jit
    def token_scores(params, inputs, targets):
        logits = forward(params, inputs, cfg.model, layout).astype(jnp.float32)
        logp = jax.nn.log_softmax(logits, axis=-1)
        picked = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
        return picked, jnp.argmax(logits, axis=-1) == targets

    def score(rows: list[tuple[list[int], int]], batch_size: int) -> list[tuple[float, bool]]:
        shards = cfg.parallel.batch_shards
        b = -(-batch_size // shards) * shards
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))  # similar lengths together
        results: dict[int, tuple[float, bool]] = {}
        for start in range(0, len(order), b):
            chunk = order[start : start + b]
            longest = max(len(rows[i][0]) - 1 for i in chunk)
            t = max(longest, min(next((x for x in BUCKETS if x >= longest), longest), cfg.model.max_seq_len))
            t = -(-t // layout.context_size) * layout.context_size
            inputs = np.zeros((b, t), np.int32)
            targets = np.zeros((b, t), np.int32)
            for r, i in enumerate(chunk):
                tokens = rows[i][0]
                inputs[r, : len(tokens) - 1] = tokens[:-1]
                targets[r, : len(tokens) - 1] = tokens[1:]
            picked, greedy = jax.device_get(
                token_scores(model.params, jax.device_put(inputs, sharding), jax.device_put(targets, sharding))
            )
            for r, i in enumerate(chunk):
                tokens, n = rows[i]
                n = min(n, len(tokens) - 1)  # a continuation longer than the window: its part inside it
                span = slice(len(tokens) - 1 - n, len(tokens) - 1)
                results[i] = (float(picked[r, span].astype(np.float64).sum()), bool(greedy[r, span].all()))
        return [results[i] for i in range(len(rows))]

    return score


def run_tasks(
    model,
    tasks: list[str],
    num_fewshot: int | None = None,
    limit: float | None = None,
    include_path: str | None = None,
    batch_size: int = 8,
    log_samples: bool = False,
) -> dict:
    """`lm_eval.simple_evaluate` of `tasks` with `model`; its results dict (samples with `log_samples`)."""
    _lm_eval()
    import lm_eval
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=include_path) if include_path else TaskManager()
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise ConfigError(
            f"unknown lm-eval task(s): {', '.join(unknown)}; this machine is offline, so a task needs local YAML and "
            "data files (--include-path DIR)"
        )
    return lm_eval.simple_evaluate(
        model=make_lm(model, batch_size),
        tasks=tasks,
        num_fewshot=num_fewshot,
        limit=limit,
        task_manager=manager,
        log_samples=log_samples,
        batch_size=batch_size,
    )
