"""Hugging Face model directories in and out: the files. What the tensors and config.json values
mean in meshlm's terms (the weight table per family, the config mapping) is `hf_tables`.

A Hugging Face model directory holds `config.json`, weights in `*.safetensors` (one file, or several
listed by `model.safetensors.index.json`), usually `generation_config.json` and tokenizer files.

Import checks the tensor names and shapes against the table (missing, extra and mis-shaped
tensors are all named before anything is read), then builds each meshlm parameter straight into
its shards: `jax.make_array_from_callback` asks for each device's slice, and only the Hugging Face
tensors of that slice's layers are read from the memory-mapped files. Pickled weights
(`*.bin`, `*.pt`, ...) are refused and never opened: unpickling runs code.

Export gathers one Hugging Face tensor at a time (a layer's slice of a stacked parameter) and
streams it into the safetensors file, so the host holds one tensor, never the model.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from meshlm.config import ConfigError, ModelConfig
from meshlm.interop import hf_deepseek
from meshlm.interop import safetensors_io as st
from meshlm.interop.hf_tables import Rule, hf_config, read_json, rules

SAFE_INDEX = "model.safetensors.index.json"
SAFE_SINGLE = "model.safetensors"
# Files that hold pickled weights (torch.save, pickle, joblib): refused, never opened.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle", ".joblib")
# Tokenizer and generation settings carried through import and export unchanged (chat templates,
# bos/eos, stop ids): meshlm reads tokenizer.json and the stop ids, and keeps the rest for the tools.
SIDE_FILES = (
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
    "chat_template.json",
)
# Buffers some checkpoints carry that are not parameters (causal masks, rotary caches).
IGNORED = re.compile(r"(\.attn\.bias|\.attn\.masked_bias|\.rotary_emb\.inv_freq)$")
HF_PREFIX = "hf:"


def token_ids(hf_dir: str | Path) -> dict[str, list[int]]:
    """{"bos_token_id": [...], "eos_token_id": [...]} from generation_config.json, else config.json
    (a single id or a list: Llama 3 Instruct stops at either of two tokens)."""
    root = Path(hf_dir).expanduser()
    out: dict[str, list[int]] = {"bos_token_id": [], "eos_token_id": []}
    for name in ("config.json", "generation_config.json"):  # the latter wins
        p = root / name
        if not p.is_file():
            continue
        data = read_json(p)
        for key in out:
            v = data.get(key)
            ids = v if isinstance(v, list) else [v]
            if v is not None and ids and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
                out[key] = list(ids)
            elif v is not None and v != []:
                raise ConfigError(f"{p}: {key} must be a token id or a list of them, got {v!r}")
    return out


def publish(tmp: Path, out: Path) -> None:
    """Rename a finished temporary directory into place, readable as the umask allows (mkdtemp
    makes it private)."""
    probe = tmp / ".mode-probe"  # a new file's mode is 0o666 & ~umask (os.umask would change it process-wide)
    probe.touch()
    umask = 0o666 & ~probe.stat().st_mode & 0o777
    probe.unlink()
    for p in [tmp, *tmp.rglob("*")]:
        p.chmod((0o777 if p.is_dir() else 0o666) & ~umask)
    if out.exists():
        out.rmdir()
    tmp.rename(out)


# ------------------------------------------------------------------------------------------ import


def weight_files(hf_dir: Path) -> list[Path]:
    """The safetensors files of a directory; pickled weights are refused without being opened."""
    if not hf_dir.is_dir():
        raise ConfigError(f"Hugging Face model directory not found: {hf_dir}")
    index = hf_dir / SAFE_INDEX
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ConfigError(f"{index}: weight_map must map tensor names to file names")
        files = sorted(set(weight_map.values()))
        bad = [f for f in files if Path(f).name != f or not f.endswith(".safetensors")]
        if bad:
            raise ConfigError(f"{index}: weight_map names files outside the directory or not safetensors: {bad}")
        missing = [f for f in files if not (hf_dir / f).is_file()]
        if missing:
            raise ConfigError(f"{index} lists files that are missing: {', '.join(missing)}")
        return [hf_dir / f for f in files]
    if (hf_dir / SAFE_SINGLE).is_file():
        return [hf_dir / SAFE_SINGLE]
    pickled = sorted(p.name for p in hf_dir.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickled:
        raise ConfigError(
            f"{hf_dir} holds pickled weights ({', '.join(pickled)}) and no safetensors; meshlm never unpickles "
            "weights (loading a pickle runs code). Convert them once, somewhere you trust the file, e.g.\n"
            '  python -c "from transformers import AutoModelForCausalLM as M; '
            f"M.from_pretrained('{hf_dir}').save_pretrained('{hf_dir}-safetensors')\""
        )
    raise ConfigError(f"{hf_dir} has no {SAFE_SINGLE} or {SAFE_INDEX}")


def _plan_import(reader: st.Reader, cfg: ModelConfig, where: Path) -> tuple[list[Rule], str]:
    """The rules, and the name prefix the files use (GPT-2 files saved by OpenAI's converter have
    no "transformer."); every missing, extra or mis-shaped tensor named."""
    interleaved = read_json(where / "config.json").get("rope_interleave", True) if cfg.mla else True
    table = rules(cfg, interleaved is not False)
    names = set(reader.tensors)
    layered = next(r for r in table if r.layered).hf.split("{i}")[0].removeprefix("transformer.")
    pattern = re.compile(r"(?:transformer\.)?" + re.escape(layered) + r"(\d+)\.")

    def layer_of(name: str) -> int | None:
        m = pattern.match(name)
        return int(m.group(1)) if m else None

    mtp = cfg.mtp_depth
    if cfg.mla:  # DeepSeek-V3's multi-token-prediction layers follow the model's (layers.{L}.*, each with an
        # eh_proj): the model's first mtp_depth read, the others not, nor their copies of the embedding and head
        stored = hf_deepseek.mtp_layers_stored(names, cfg.n_layers)
        unused = range(cfg.n_layers + mtp, cfg.n_layers + max(stored, mtp))
        names = {n for n in names if layer_of(n) not in unused}
        names = {n for n in names if (layer_of(n) or 0) < cfg.n_layers or not n.endswith(hf_deepseek.SHARED_COPIES)}
        if mtp > stored:
            raise ConfigError(f"model.mtp_depth={mtp}, but the weights in {where} hold {stored} MTP layers")
    present = {i for n in names if (i := layer_of(n)) is not None}
    if present != set(range(cfg.n_layers + mtp)):
        raise ConfigError(
            f"{where}/config.json says {cfg.n_layers} layers, but the weights hold layers "
            f"{sorted(present)[:5]}{'...' if len(present) > 5 else ''} ({len(present)} in all)"
        )
    scales = {n for n in names if n.endswith(st.SCALE_SUFFIX) and n.removesuffix(st.SCALE_SUFFIX) in names}
    names -= scales  # FP8 weights' block scales: read with their weights (`st.Reader.get`)
    fp8 = {n for n in names if reader.tensors[n].dtype == st.FP8}
    unscaled = sorted(n for n in fp8 if n + st.SCALE_SUFFIX not in scales)
    if unscaled:
        raise ConfigError(
            f"{where}: FP8 tensors without their block scales (<name>_scale_inv): {', '.join(unscaled[:5])}"
        )
    not_float = sorted(n for n in names - fp8 if reader.tensors[n].dtype not in st.FLOATS and not IGNORED.search(n))
    if not_float:
        raise ConfigError(
            f"{where}: tensors stored as integers or booleans (quantized weights?) are not supported: "
            + ", ".join(f"{n} ({reader.tensors[n].dtype})" for n in not_float[:5])
        )
    prefix = ""
    if cfg.family == "gpt" and "transformer.wte.weight" not in names and "wte.weight" in names:
        prefix = "transformer."
    want: dict[str, tuple[int, ...]] = {}
    for r in table:
        for n in r.names(cfg.n_layers):
            want[n.removeprefix(prefix) if prefix and n.startswith(prefix) else n] = r.hf_shape
    problems = [f"missing tensor {n} (expected shape {list(s)})" for n, s in want.items() if n not in names]
    problems += [
        f"tensor {n} has shape {list(reader.tensors[n].shape)}, expected {list(s)}"
        for n, s in want.items()
        if n in names and reader.tensors[n].shape != s
    ]
    tied_alias = {"lm_head.weight"} if cfg.tied_embeddings else set()
    extra = sorted(n for n in names - want.keys() if not IGNORED.search(n) and n not in tied_alias)
    problems += [f"unexpected tensor {n} (not part of a meshlm {cfg.family} model)" for n in extra]
    if problems:
        raise ConfigError(
            f"the weights in {where} do not match its config.json:\n  "
            + "\n  ".join(problems[:20])
            + (f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else "")
        )
    return table, prefix


def _fp8_block(root: Path) -> tuple[int, int]:
    """The block of an FP8 checkpoint's scales (config.json's quantization_config.weight_block_size)."""
    path = root / "config.json"
    quant = (read_json(path).get("quantization_config") or {}) if path.is_file() else {}
    block = quant.get("weight_block_size", [128, 128])
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ConfigError(f"{path}: quantization_config.weight_block_size must be two positive integers, got {block!r}")
    return block[0], block[1]


def load_params(hf_dir: str | Path, cfg: ModelConfig, shardings: dict) -> dict:
    """meshlm's fp32 parameter tree from a Hugging Face directory, each leaf built directly into
    `shardings` (a tree like the params, e.g. `train_state.param_shardings`)."""
    import jax

    from meshlm.model.params import abstract_params, named_leaves, param_specs

    root = Path(hf_dir).expanduser()
    reader = st.Reader(weight_files(root), _fp8_block(root))
    try:
        table, prefix = _plan_import(reader, cfg, root)
        abstract = named_leaves(abstract_params(param_specs(cfg)))
        named_sh = named_leaves(shardings)
        by_leaf: dict[str, list[Rule]] = {}
        for r in table:
            by_leaf.setdefault(r.leaf, []).append(r)
        built = {}
        for leaf, shape_dtype in abstract.items():
            if leaf == "layers/router_bias" and leaf not in by_leaf:  # a bias the checkpoint has not: it starts at 0
                built[leaf] = jax.device_put(np.zeros(shape_dtype.shape, np.float32), named_sh[leaf])
                continue
            (rule,) = by_leaf[leaf]
            built[leaf] = _build_leaf(reader, rule, prefix, shape_dtype.shape, named_sh[leaf])
        treedef = jax.tree.structure(abstract_params(param_specs(cfg)))
        return jax.tree.unflatten(treedef, [built[n] for n in abstract])
    finally:
        reader.close()


def _build_leaf(reader: st.Reader, rule: Rule, prefix: str, shape: tuple[int, ...], sharding) -> Any:
    import jax

    def hf_name(index) -> str:
        n = rule.name(index)
        return n.removeprefix(prefix) if prefix else n

    def read(i: int | None, per: tuple[int, ...]) -> np.ndarray:
        """Layer i's value (stacked over the experts: each of them is its own tensor)."""
        if rule.experts:
            return np.stack([rule.to_meshlm(reader.get(hf_name((i, e))), per[1:]) for e in range(rule.experts)])
        return rule.to_meshlm(reader.get(hf_name(i)), per)

    # Each HF tensor is read and converted once per leaf and dropped after the last device slice
    # that needs it; a slice several devices hold (replicas) is built once and dropped after its
    # last copy. So the host holds at most one stacked parameter (fp32) beyond the shards.
    layers_of = lambda index: list(range(*index[0].indices(shape[0]))) if rule.layered else [None]
    indices = list(sharding.addressable_devices_indices_map(shape).values())
    copies = Counter(repr(ix) for ix in indices)
    distinct = {repr(ix): ix for ix in indices}
    uses = Counter(i for ix in distinct.values() for i in layers_of(ix))
    converted: dict[int | None, np.ndarray] = {}
    done: dict[str, np.ndarray] = {}

    def one(i: int | None, per: tuple[int, ...], idx: tuple) -> np.ndarray:
        if i not in converted:
            converted[i] = np.asarray(read(i, per), dtype=np.float32)
        out = np.array(converted[i][idx])
        uses[i] -= 1
        if uses[i] <= 0:
            del converted[i]
        return out

    def callback(index: tuple) -> np.ndarray:
        key = repr(index)
        if key not in done:
            if rule.layered:
                done[key] = np.stack([one(i, shape[1:], index[1:]) for i in layers_of(index)])
            else:
                done[key] = one(None, shape, index)
        out = done[key]
        copies[key] -= 1
        if copies[key] <= 0:
            del done[key]
        return out

    return jax.make_array_from_callback(shape, sharding, callback)


# ------------------------------------------------------------------------------------------ export


Sources = list[tuple[Rule, Any]]  # the meshlm leaves (and layer, or (layer, expert)) one HF tensor is made of


def save_pretrained(
    params: dict,
    cfg: ModelConfig,
    out_dir: str | Path,
    *,
    tokenizer_file: Path | None = None,
    eos_token: str | None = None,
    dtype: str = "float32",
    max_shard_bytes: int = 2 * 2**30,
    max_positions: int = 0,
    side_files: Path | None = None,
    log: Callable[[str], None] = print,
) -> Path:
    """Write a Hugging Face directory (config, generation config, safetensors shards + index,
    tokenizer) from meshlm parameters (global arrays, any sharding). `side_files`: a directory
    whose tokenizer_config.json, generation_config.json, ... (`SIDE_FILES`, kept by an import)
    are copied instead of meshlm's own. Written under a temporary name and renamed into place: a
    failure leaves nothing at `out_dir`."""
    out = Path(out_dir).expanduser().absolute()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out} exists and is not empty; export into a new directory")
    np_dtype = st.numpy_dtype(dtype)
    tensors = _hf_tensors(cfg)
    files = _shard_files(tensors, np_dtype.itemsize, max_shard_bytes)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        total = _write_weights(tmp, files, params, np_dtype)
        bos, eos = _write_tokenizer(tmp, tokenizer_file, eos_token, cfg.max_seq_len)
        kept = [f for f in SIDE_FILES if side_files is not None and (side_files / f).is_file()]
        for f in kept:  # an imported model's own settings (chat template, bos/eos, stop ids)
            shutil.copyfile(side_files / f, tmp / f)
        if kept:
            ids = token_ids(tmp)
            bos = ids["bos_token_id"][0] if ids["bos_token_id"] else bos
            eos = ids["eos_token_id"][0] if ids["eos_token_id"] else eos
        (tmp / "config.json").write_text(json.dumps(hf_config(cfg, bos, eos, dtype, max_positions), indent=2))
        if "generation_config.json" not in kept:
            gen = {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": eos}
            (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2))
        publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log(f"wrote {out}: {len(tensors)} tensors in {len(files)} file(s), {total / 2**20:,.1f} MiB {dtype}")
    return out


def _hf_tensors(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...], Sources]]:
    """Every Hugging Face tensor of the model in natural name order: (name, shape, its sources)."""
    tensors: dict[str, tuple[tuple[int, ...], Sources]] = {}
    for r in rules(cfg):
        for index in r.indices(cfg.n_layers):
            tensors.setdefault(r.name(index), (r.hf_shape, []))[1].append((r, index))
    return [(name, shape, src) for name, (shape, src) in sorted(tensors.items(), key=lambda t: _natural(t[0]))]


def _shard_files(tensors: list, itemsize: int, max_bytes: int) -> list[list]:
    """The tensors grouped into files of at most `max_bytes` (a larger tensor gets a file of its own)."""
    files: list[list] = [[]]
    size = 0
    for tensor in tensors:
        nbytes = math.prod(tensor[1]) * itemsize
        if files[-1] and size + nbytes > max_bytes:
            files.append([])
            size = 0
        files[-1].append(tensor)
        size += nbytes
    return files


def _write_weights(tmp: Path, files: list[list], params: dict, np_dtype: np.dtype) -> int:
    """The safetensors files (and their index when there are several), one tensor gathered from
    the devices at a time; returns the bytes written."""
    import jax

    from meshlm.model.params import named_leaves

    leaves = named_leaves(params)

    def gather(sources: Sources, shape: tuple[int, ...]) -> np.ndarray:
        if sources[0][0].rows is not None:  # leaves holding rows of one tensor (MLA's kv_b_proj, RoPE order)
            out = np.zeros(shape, np.float32)
            for rule, i in sources:
                x = leaves[rule.leaf] if i is None else leaves[rule.leaf][i]
                out[np.asarray(rule.rows)] = rule.to_hf(np.asarray(jax.device_get(x)))
            return out
        chunks = []
        for rule, i in sorted(sources, key=lambda s: s[0].part):
            x = leaves[rule.leaf] if i is None else leaves[rule.leaf][i]
            chunks.append(rule.to_hf(np.asarray(jax.device_get(x))))
        return np.concatenate(chunks, axis=-1) if len(chunks) > 1 else chunks[0]

    many = len(files) > 1
    weight_map, total = {}, 0
    for k, group in enumerate(files):
        fname = f"model-{k + 1:05d}-of-{len(files):05d}.safetensors" if many else SAFE_SINGLE
        specs = [(name, shape, np_dtype) for name, shape, _ in group]
        st.write(tmp / fname, specs, (gather(src, shape) for _, shape, src in group), {"format": "pt"})
        weight_map |= {name: fname for name, _, _ in group}
        total += sum(math.prod(shape) * np_dtype.itemsize for _, shape, _ in group)
    if many:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / SAFE_INDEX).write_text(json.dumps(index, indent=2))
    return total


def _write_tokenizer(tmp: Path, tokenizer_file: Path | None, eos_token: str | None, max_len: int):
    """tokenizer.json and meshlm's tokenizer settings; returns the (bos, eos) ids (None without one)."""
    if tokenizer_file is None:
        return None, None
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_file))
    eos = tok.token_to_id(eos_token) if eos_token else None
    shutil.copyfile(tokenizer_file, tmp / "tokenizer.json")
    special = {"bos_token": eos_token, "eos_token": eos_token, "unk_token": eos_token}
    settings = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": max_len,
        "clean_up_tokenization_spaces": False,
        "add_prefix_space": False,
    }
    (tmp / "tokenizer_config.json").write_text(json.dumps(settings | special, indent=2))
    (tmp / "special_tokens_map.json").write_text(json.dumps(special, indent=2))
    return eos, eos  # GPT-2 convention: one end-of-text token begins and ends documents


def _natural(name: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


def is_hf_ref(path: str | None) -> bool:
    return bool(path) and str(path).startswith(HF_PREFIX)


def hf_path(ref: str) -> Path:
    return Path(ref.removeprefix(HF_PREFIX)).expanduser()


def save_peft(
    params: dict, cfg: ModelConfig, out_dir: str | Path, base: str = "", log: Callable[[str], None] = print
) -> Path:
    """A PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors) of a llama
    family run's adapters, which `peft.PeftModel.from_pretrained(<the base model>, out_dir)` loads:
    per layer lora_A.weight [r, in] = A^T and lora_B.weight [out, r] = B^T, scaling lora_alpha / r,
    under the modules the import table (`hf_tables.rules`) maps each target to. MLA's query and
    key-value rows are reordered as its import reorders the base weights' (RoPE's interleaved rows,
    as the base's config.json says). `base`: the base model's path, recorded as
    base_model_name_or_path."""
    if not cfg.lora_rank:
        raise ConfigError("this run has no LoRA adapters (model.lora_rank = 0); export it with --to-hf")
    if cfg.family != "llama":
        raise ConfigError(
            "--peft: PEFT adapters are written for the llama family (GPT-2's fused c_attn has one adapter for "
            "Q, K and V together, meshlm's three); export the merged weights with --to-hf instead"
        )
    out = Path(out_dir).expanduser().absolute()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out} exists and is not empty; export into a new directory")
    tensors, modules = _peft_tensors(params, cfg, _peft_table(cfg, base))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        specs = [(n, t.shape, np.dtype(np.float32)) for n, t in tensors]
        st.write(tmp / "adapter_model.safetensors", specs, (t for _, t in tensors), {"format": "pt"})
        config = {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": base,
            "r": cfg.lora_rank,
            "lora_alpha": cfg.lora_alpha,
            "lora_dropout": cfg.lora_dropout,
            "target_modules": sorted(modules),
            "bias": "none",
            "fan_in_fan_out": False,
            "use_rslora": False,
            "use_dora": False,
            "inference_mode": True,
        }
        (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2))
        publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log(f"wrote {out}: a PEFT LoRA adapter, r={cfg.lora_rank} on {', '.join(cfg.lora_targets)}, {cfg.n_layers} layers")
    return out


def _peft_table(cfg: ModelConfig, base: str) -> dict[str, Rule]:
    """The import table (leaf -> Rule) in the base checkpoint's row order: the rows an MLA import
    moves depend on its rope_interleave, read from the base's config.json (refused without it)."""
    from meshlm.model.lora import STACKS

    interleaved, plain = ({r.leaf: r for r in rules(cfg, i)} for i in (True, False))
    moved = lambda t: any(interleaved.get(f"{s}/{t}") != plain.get(f"{s}/{t}") for s in STACKS)
    reordered = [t for t in cfg.lora_targets if moved(t)]
    if not reordered:
        return interleaved
    config_json = Path(base) / "config.json" if base else None
    if config_json is None or not config_json.is_file():
        raise ConfigError(
            f"--peft: the {', '.join(reordered)} adapters are written in the base checkpoint's row order "
            f"(its rope_interleave), and its config.json is not at hand ({base or 'no base recorded'}); "
            "export the merged weights with --to-hf instead"
        )
    return interleaved if read_json(config_json).get("rope_interleave", True) is not False else plain


def _peft_tensors(params: dict, cfg: ModelConfig, table: dict[str, Rule]) -> tuple[list, set[str]]:
    """(PEFT's tensors [(name, array)], the module names adapted) of every stack's adapters, each
    layer under its model index, in the HF tensors' order the import `table` (leaf -> Rule) gives."""
    import jax

    from meshlm.model.lora import STACKS
    from meshlm.model.params import named_leaves

    leaves, r = named_leaves(params), cfg.lora_rank
    tensors, modules = [], set()
    for name in cfg.lora_targets:
        for leaf in (f"{stack}/{name}" for stack in STACKS):
            if f"{leaf}_lora_a" not in leaves:
                continue
            rule = table[leaf]
            if rule.parts > 1 or (rule.rows is not None and sorted(rule.rows) != list(range(rule.hf_shape[0]))):
                raise ConfigError(f"--peft: {leaf} is part of {rule.hf}, which one adapter cannot stand for")
            a = np.asarray(jax.device_get(leaves[f"{leaf}_lora_a"]), np.float32)
            b = np.asarray(jax.device_get(leaves[f"{leaf}_lora_b"]), np.float32)
            for j in range(a.shape[0]):
                module = rule.name(j).removesuffix(".weight")
                lora_b = b[j].reshape(r, -1).T  # [out, r] in meshlm's row order
                if rule.rows is not None:  # in HF's: its row rows[k] is meshlm's row k
                    lora_b = lora_b[np.argsort(rule.rows)]
                prefix = f"base_model.model.{module}"
                tensors.append((f"{prefix}.lora_A.weight", np.ascontiguousarray(a[j].reshape(-1, r).T)))
                tensors.append((f"{prefix}.lora_B.weight", np.ascontiguousarray(lora_b)))
                modules.add(module.rsplit(".", 1)[-1])
    return tensors, modules
