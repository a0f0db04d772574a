"""`meshlm eval --tasks`: lm-evaluation-harness through meshlm's model, against lm_eval's own
Hugging Face backend on the same checkpoint (a small random-weight Llama made by `transformers`),
on a local multiple-choice task and a perplexity task, on one device and on tensor=2."""

import json

import numpy as np
import pytest

from helpers import save_tiny_llama
from meshlm.config import ConfigError, ParallelConfig

pytest.importorskip("lm_eval")

WORDS = ["alpha", "beta", "gamma", "delta", "mesh", "shard", "token", "layer", "device", "batch"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from meshlm.data import tokenizer as toks

    root = tmp_path_factory.mktemp("hf-llama")
    rng = np.random.default_rng(0)
    tok = toks.train_bpe([" ".join(rng.choice(WORDS, 12)) for _ in range(200)], 300)
    save_tiny_llama(root, tok, toks.EOT, tok.get_vocab_size(), std=0.2)  # the choices' scores differ clearly
    return root


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    """A multiple-choice task, a rolling-loglikelihood (perplexity) task and a greedy generation
    task (stopping at a word), YAML + JSONL."""
    root = tmp_path_factory.mktemp("tasks")
    rng = np.random.default_rng(1)
    with open(root / "mc.jsonl", "w") as f:
        for _ in range(12):
            choices = [" ".join(rng.choice(WORDS, int(rng.integers(1, 4)))) for _ in range(3)]
            q = " ".join(rng.choice(WORDS, 6))
            f.write(json.dumps({"question": q, "choices": choices, "answer": int(rng.integers(0, 3))}) + "\n")
    with open(root / "ppl.jsonl", "w") as f:
        for n in (5, 30, 90):  # the longest spans two rolling windows of the 64-token model
            f.write(json.dumps({"text": " ".join(rng.choice(WORDS, n))}) + "\n")
    (root / "mc.yaml").write_text(
        "task: meshlm_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {root / 'mc.jsonl'}\ntest_split: test\noutput_type: multiple_choice\n"
        "doc_to_text: '{{question}}:'\ndoc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\n"
        "metric_list:\n  - metric: acc\n"
    )
    (root / "gen.yaml").write_text(
        "task: meshlm_gen\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {root / 'mc.jsonl'}\ntest_split: test\noutput_type: generate_until\n"
        "doc_to_text: '{{question}}:'\ndoc_to_target: '{{choices[0]}}'\n"
        "generation_kwargs:\n  until: ['gamma']\n  max_gen_toks: 6\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n"
    )
    (root / "ppl.yaml").write_text(
        "task: meshlm_ppl\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {root / 'ppl.jsonl'}\ntest_split: test\noutput_type: loglikelihood_rolling\n"
        "doc_to_text: ''\ndoc_to_target: '{{text}}'\n"
        "metric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n"
    )
    return root


def _scores(out: dict, task: str) -> np.ndarray:
    """Every request's log-likelihood, in document then choice order."""
    return np.asarray(
        [r[0] if isinstance(r, list | tuple) else r for s in out["samples"][task] for r in s["resps"]], dtype=np.float64
    ).reshape(-1)


@pytest.fixture(scope="module")
def reference(hf_dir, tasks):
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    hflm = HFLM(pretrained=str(hf_dir), device="cpu", dtype="float32", batch_size=4)
    return lm_eval.simple_evaluate(
        model=hflm,
        tasks=["meshlm_mc", "meshlm_ppl", "meshlm_gen"],
        task_manager=TaskManager(include_path=str(tasks)),
        log_samples=True,
    )


@pytest.mark.parametrize("mesh", [{}, {"tensor": 2}])
def test_loglikelihoods_equal_lm_evals_hugging_face_backend(mesh, hf_dir, tasks, reference):
    """Per request, meshlm's log-likelihoods equal lm_eval's HF backend's (1e-4), so the accuracy and
    perplexities are the same, and its greedy generations are the same text; on one device and
    with the weights split over tensor=2."""
    from meshlm.inference import load_model
    from meshlm.interop.harness import run_tasks

    model = load_model(f"hf:{hf_dir}", parallel=ParallelConfig(**mesh))
    out = run_tasks(
        model, ["meshlm_mc", "meshlm_ppl", "meshlm_gen"], include_path=str(tasks), batch_size=4, log_samples=True
    )
    generated = [s["resps"] for s in out["samples"]["meshlm_gen"]]
    assert generated == [s["resps"] for s in reference["samples"]["meshlm_gen"]]
    assert any(r[0][0] for r in generated)  # not all empty
    for task in ("meshlm_mc", "meshlm_ppl"):
        got, want = _scores(out, task), _scores(reference, task)
        assert len(got) == len(want) > 0
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-5)
    acc = out["results"]["meshlm_mc"]["acc,none"]
    assert acc == reference["results"]["meshlm_mc"]["acc,none"]
    assert 0 < acc < 1  # the choices are told apart: a broken scorer would not land on the same
    ppl = out["results"]["meshlm_ppl"]
    np.testing.assert_allclose(
        ppl["bits_per_byte,none"], reference["results"]["meshlm_ppl"]["bits_per_byte,none"], rtol=1e-5
    )


def test_cli_and_clear_errors(hf_dir, tasks, capsys, tmp_path):
    from meshlm.cli import main

    args = ["eval", "--run-dir", f"hf:{hf_dir}", "--include-path", str(tasks), "--limit", "4"]
    assert main([*args, "--tasks", "meshlm_mc", "--json", "--output", str(tmp_path / "out.json")]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert "acc,none" in result["results"]["meshlm_mc"]
    assert len(json.loads((tmp_path / "out.json").read_text())["samples"]["meshlm_mc"]) == 4
    from meshlm.inference import load_model
    from meshlm.interop.harness import run_tasks

    with pytest.raises(ConfigError, match="offline"):
        run_tasks(load_model(f"hf:{hf_dir}"), ["no_such_task"], include_path=str(tasks))
