"""docs/finetune.md's walkthrough, run as written: a random-weight Llama made by `transformers`
(with a ChatML template) imported, chat data prepared with loss masks, LoRA fine-tuning, evaluation
on the packed split and on a local lm-eval task, merged and PEFT exports; then `transformers` loads
the merged export and generates what meshlm generates."""

import json
import random
import re
import shlex
from pathlib import Path

import numpy as np
import pytest

from helpers import save_tiny_llama

DOC = Path(__file__).resolve().parents[1] / "docs" / "finetune.md"
WORDS = ["the", "model", "answers", "questions", "about", "meshes", "shards", "tokens", "and", "layers", "with", "care"]
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def blocks(kind: str) -> list[str]:
    return re.findall(rf"```{kind}\n(.*?)```", DOC.read_text(), re.S)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    from meshlm.data import tokenizer as toks

    root = tmp_path_factory.mktemp("walkthrough")
    hf, work = root / "hf", root / "work"
    work.mkdir()
    rng = random.Random(0)
    say = lambda n: " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, n)))
    tok = toks.train_bpe([say(30) for _ in range(300)], 300)
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    save_tiny_llama(hf, tok, "<|im_end|>")
    (hf / "chat_template.jinja").write_text(CHATML)
    with open(work / "chats.jsonl", "w") as f:
        for _ in range(60):
            msgs = [{"role": "user", "content": say(5)}, {"role": "assistant", "content": say(6)}]
            f.write(json.dumps({"messages": msgs}) + "\n")
    with open(work / "qa.jsonl", "w") as f:
        for _ in range(8):
            f.write(json.dumps({"question": say(6), "choices": [say(2), say(2)], "answer": rng.randint(0, 1)}) + "\n")
    (work / "tasks").mkdir()
    (work / "tasks" / "qa.yaml").write_text(blocks("yaml")[0].replace("$WORK", str(work)))
    return hf, work


def test_the_walkthrough_runs_as_written(work, capsys):
    import torch
    from transformers import AutoModelForCausalLM

    from meshlm.cli import main
    from meshlm.inference import Generator, load_model

    hf, work = work
    (commands,) = re.findall(r"<!-- walkthrough:start -->\n```bash\n(.*?)```", DOC.read_text(), re.S)
    for line in commands.strip().splitlines():
        line = line.replace("$HF", str(hf)).replace("$WORK", str(work))
        capsys.readouterr()
        assert main(shlex.split(line)[1:]) == 0, line
        if "--tasks" in line:
            results = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["results"]
            assert 0 <= results["qa"]["acc,none"] <= 1
    info = json.loads((work / "run" / "run.json").read_text())
    assert info["startup_report"]["lora"].endswith("dropout 0.05") and info["data"]["packed"]["format"] == "chat"
    steps = sorted((work / "run" / "checkpoints").iterdir(), key=lambda p: p.name)
    meta = json.loads((steps[-1] / "meta" / "metadata").read_text())
    assert meta["base"]["source"] == str(work / "base" / "checkpoints" / "0")  # the adapters' base: the import
    adapter = json.loads((work / "adapter" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == str(hf.absolute())  # through the convert --from-hf import
    assert adapter["lora_dropout"] == 0.05
    # the doc's Python: transformers loads the merged export (its chat template kept) and generates
    (snippet,) = blocks("python")
    capsys.readouterr()
    exec(snippet.replace("$WORK", str(work)), {})
    assert "<|im_start|>assistant" in capsys.readouterr().out
    # ... the same tokens meshlm's own greedy decoding gives
    model = load_model(work / "run")
    prompt = model.encode("<|im_start|>user\nwhat is a mesh<|im_end|>\n<|im_start|>assistant\n")
    ours = Generator(model).generate([prompt], 8, temperature=0.0, stop_at_eos=False).tokens[0]
    with torch.no_grad():
        out = AutoModelForCausalLM.from_pretrained(work / "merged").generate(
            torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None
        )
    np.testing.assert_array_equal(out[0, len(prompt) :].numpy(), ours)
