"""The CUDA tier, the bidirectional encoder (issue 66): masked-LM pretraining with NSP,
fine-tuning to classify and to tag, and every encoder command on a GPU, fill-mask and the
classifier held to the CPU's answers. Run by `make test-gpu` (`-m cuda`); skipped without
a GPU; `TLM_TIER_DEVICE=cpu` runs it on the CPU to check the tier itself."""

import json
import random

import pytest

from conftest import WORDS
from tlm.cli import main

pytestmark = pytest.mark.cuda

SHAPE = ["--d-model", "64", "--n-layers", "2", "--n-heads", "4", "--context-length", "32"]
SHAPE += ["--position", "rope", "--norm", "pre", "--batch-size", "16", "--quiet"]


def labeled(folder, seed: int = 0):
    """A classify file (does the text name "import"?) and a tag file (B-KW on "return")."""
    rng, texts, tags = random.Random(seed), [], []
    for _ in range(300):
        words = rng.choices(WORDS, k=rng.randint(3, 8))
        texts.append({"text": " ".join(words), "label": "yes" if "import" in words else "no"})
        tags.append({"tokens": words, "tags": ["B-KW" if w == "return" else "O" for w in words]})
    files = {"classify": folder / "cls.jsonl", "tag": folder / "tag.jsonl"}
    for task, rows in (("classify", texts), ("tag", tags)):
        files[task].write_text("".join(json.dumps(r) + "\n" for r in rows))
    return files


def test_the_encoder_on_the_gpu(words_data, tmp_path, gpu, capsys):
    device = ["--device", str(gpu)]
    mlm = tmp_path / "mlm"
    args = ["train", "--objective", "mlm", "--nsp", "--data", str(words_data), "--out", str(mlm)]
    assert main([*args, *SHAPE, *device, "--max-steps", "60", "--lr", "3e-3"]) == 0
    rows = [json.loads(r) for r in (mlm / "metrics.jsonl").read_text().splitlines()]
    assert "val_nsp_accuracy" in [r for r in rows if "val_loss" in r][-1]
    files = labeled(tmp_path)
    for task, file in files.items():
        args = ["train", "--task", task, "--init-from", str(mlm), "--data", str(file)]
        args += ["--out", str(tmp_path / task), "--max-steps", "30", "--lr", "1e-3"]
        assert main([*args, *device, "--batch-size", "16", "--quiet"]) == 0
    capsys.readouterr()
    answers = []
    for where in (device, ["--device", "cpu"]):
        assert main(["fill-mask", str(mlm), "pyt[MASK]on module", "--json", *where]) == 0
        filled = json.loads(capsys.readouterr().out)["masks"][0]
        classify = ["classify", str(tmp_path / "classify"), "import module", "--json", *where]
        assert main(classify) == 0
        answers.append((filled, json.loads(capsys.readouterr().out)))
    (gpu_fill, gpu_class), (cpu_fill, cpu_class) = answers
    assert [c["token"] for c in gpu_fill] == [c["token"] for c in cpu_fill]
    for a, b in zip(gpu_fill, cpu_fill, strict=True):
        assert a["probability"] == pytest.approx(b["probability"], abs=1e-3)
    assert gpu_class["label"] == cpu_class["label"]
    text = tmp_path / "texts.txt"
    text.write_text("python module\nimport string\nreturn object\n")
    commands = [
        ["tag", str(tmp_path / "tag"), "python return module"],
        ["eval", str(tmp_path / "tag"), "--data", str(files["tag"]), "--json"],
        ["embed", str(mlm), str(text), "--out", str(tmp_path / "v.npy"), "--anisotropy"],
        ["inspect", str(mlm), "--prompt", "pyt[MASK]on", "--out", str(tmp_path / "page")],
    ]
    for command in commands:
        assert main([*command, *device]) == 0, command


def test_demo_encoder_on_the_gpu(tmp_path, gpu):
    pytest.importorskip("sklearn")
    args = ["demo", "encoder", "--data", str(tmp_path / "data"), "--out", str(tmp_path / "enc")]
    args += ["--mlm-steps", "5", "--classify-steps", "5", "--tag-steps", "5", "--quiet"]
    assert main([*args, "--device", str(gpu)]) == 0
    figures = json.loads((tmp_path / "enc" / "encoder_eval.json").read_text())
    assert set(figures) == {"mlm", "classify", "tag"}
    config = json.loads((tmp_path / "enc" / "mlm" / "config.json").read_text())
    assert config["train"]["device"] == str(gpu)
