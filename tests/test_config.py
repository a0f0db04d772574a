"""Config overrides, mesh parsing and validation: every bad input gets a message naming the field."""

import dataclasses

import pytest

from meshlm import recipes
from meshlm.config import ConfigError, RunConfig, apply_overrides, from_dict, parse_mesh
from meshlm.validation import validate


def test_overrides_are_typed():
    cfg = apply_overrides(
        recipes.get("tiny"),
        ["model.n_layers=6", "model.dropout=0.25", "model.dtype=bfloat16", "train.steps=1e3", "data.paths=a,b"],
    )
    assert cfg.model.n_layers == 6 and isinstance(cfg.model.n_layers, int)
    assert cfg.model.dropout == 0.25 and cfg.model.dtype == "bfloat16"
    assert cfg.train.steps == 1000
    assert cfg.data.paths == ("a", "b")
    assert apply_overrides(cfg, ["model.family=llama"]).model.family == "llama"


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.n_layer=3", "ModelConfig has no field 'n_layer'"),
        ("modle.n_layers=3", "unknown config section 'modle'"),
        ("model.n_layers=three", "ModelConfig.n_layers expects an integer, got 'three'"),
        ("model.n_layers=2.5", "expects an integer"),
        ("model.dtype=float16", "ModelConfig.dtype='float16' is not one of float32, bfloat16"),
        ("model.family=bert", "is not one of gpt, llama"),
        ("optim.lr=fast", "OptimConfig.lr expects a number"),
        ("n_layers=3", "section.key"),
        ("model.n_layers", "section.key=value"),
    ],
)
def test_bad_override_is_named(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        apply_overrides(RunConfig(), [override])


def test_parse_mesh():
    assert parse_mesh("data=2,tensor=4") == {"stage": 1, "data": 2, "fsdp": 1, "expert": 1, "context": 1, "tensor": 4}
    assert parse_mesh("stage=4,tensor=2")["stage"] == 4
    assert parse_mesh("context=4,tensor=2")["context"] == 4
    with pytest.raises(ConfigError, match="unknown mesh axis 'pipe'"):
        parse_mesh("pipe=2")
    with pytest.raises(ConfigError, match="needs an integer"):
        parse_mesh("data=x")


def _with(cfg, **sections):
    return dataclasses.replace(cfg, **{k: dataclasses.replace(getattr(cfg, k), **v) for k, v in sections.items()})


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(parallel=dict(tensor=3)), "model.n_heads=4 is not divisible by mesh axis 'tensor' (size 3)"),
        (
            dict(model=dict(family="llama", n_heads=8, n_kv_heads=2), parallel=dict(tensor=4)),
            "model.n_kv_heads=2 is not divisible by mesh axis 'tensor' (size 4)",
        ),
        (dict(model=dict(n_heads=8, vocab_size=2050), parallel=dict(tensor=8)), "model.vocab_size=2050"),
        (dict(model=dict(n_heads=8, d_ff=100), parallel=dict(tensor=8)), "model.d_ff=100"),
        (
            dict(model=dict(d_model=100, head_dim=25), parallel=dict(fsdp=8)),
            "model.d_model=100 is not divisible by mesh axis 'fsdp'",
        ),
        (dict(parallel=dict(data=3)), "microbatch size 16 .* data\\*fsdp\\*expert=3"),
        (dict(train=dict(microbatches=3)), "train.global_batch=16 is not divisible by train.microbatches=3"),
        (dict(model=dict(n_heads=6)), "d_model=128 is not divisible by n_heads=6"),
        (dict(train=dict(seq_len=256)), "train.seq_len=256 exceeds model.max_seq_len=128"),
        (dict(remat=dict(policy="most")), "remat.policy='most' unknown"),
        (dict(model=dict(family="llama", dropout=0.1)), "dropout is only implemented for the gpt family"),
    ],
)
def test_validate_names_the_problem(change, message):
    cfg = _with(recipes.get("tiny"), **change)
    escaped = message.replace("(", r"\(").replace(")", r"\)") if "\\" not in message else message
    with pytest.raises(ConfigError, match=escaped):
        validate(cfg)


@pytest.mark.parametrize("name", list(recipes.RECIPES))
def test_every_recipe_validates_and_round_trips(name):
    cfg = validate(recipes.get(name))
    assert from_dict(cfg.to_dict()) == cfg
    import json

    assert from_dict(json.loads(cfg.to_json())) == cfg


def test_unknown_recipe():
    with pytest.raises(ConfigError, match="unknown recipe 'gpt-5'; available: tiny"):
        recipes.get("gpt-5")


def test_remat_names_are_the_registrys():
    import typing

    from meshlm.config import RematPolicy
    from meshlm.parallel.remat import POLICIES

    assert list(typing.get_args(RematPolicy)) == list(POLICIES)


def test_config_cli_and_device_table_import_no_jax():
    """Validation and argument parsing stay JAX-free: the CLI sets the simulated device count
    before JAX is imported, and config imports no registry."""
    import subprocess
    import sys

    code = (
        "import sys; import meshlm.config, meshlm.validation, meshlm.platform.hardware, meshlm.cli; "
        "import meshlm.launch.supervisor, meshlm.recipes; "
        "meshlm.validation.validate(meshlm.recipes.get('llama-1b')); "
        "assert 'jax' not in sys.modules, [m for m in sys.modules if m.startswith('jax')][:5]"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_no_library_module_imports_the_cli():
    """Importing every meshlm module but the CLI's own never loads `meshlm.cli` (no cycles back)."""
    import subprocess
    import sys

    code = (
        "import importlib, pathlib, sys, meshlm\n"
        "root = pathlib.Path(meshlm.__path__[0])\n"  # by file: walk_packages would import the cli package
        "for f in sorted(root.rglob('*.py')):\n"
        "    name = '.'.join(('meshlm',) + f.relative_to(root).with_suffix('').parts).removesuffix('.__init__')\n"
        "    if name != 'meshlm.__main__' and not name.startswith('meshlm.cli'):\n"
        "        importlib.import_module(name)\n"
        "assert 'meshlm.cli' not in sys.modules, 'a library module imports meshlm.cli'\n"
        "assert 'meshlm.launch.supervisor' in sys.modules and 'meshlm.trainer' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
