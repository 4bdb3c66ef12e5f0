"""The CUDA tier, commands (issue 62): training, every command that runs a model, the
server, export and import, and both demos, on a GPU, each held to the CPU's result where the
two compute the same. Run by `make test-gpu` (`-m cuda`); skipped without a GPU;
`TLM_TIER_DEVICE=cpu` runs it on the CPU to check the tier itself.
"""

import json
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from tlm.checkpoint import latest_checkpoint
from tlm.cli import main
from tlm.load import load_model, load_tokenizer

pytestmark = pytest.mark.cuda

SHAPE = ["--n-layers", "2", "--d-model", "32", "--n-heads", "2", "--context-length", "32"]
SHAPE += ["--batch-size", "8", "--eval-interval", "20", "--quiet"]


def train(data, run, device, *extra) -> int:
    args = ["train", "--data", str(data), "--out", str(run), "--device", str(device), *SHAPE]
    return main([*args, *extra])


def losses(run) -> list[float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["train_loss"] for r in rows if "train_loss" in r]


@pytest.fixture(scope="module")
def gpu_run(docs_chars, tmp_path_factory, gpu):
    run = tmp_path_factory.mktemp("gpu") / "run"
    assert train(docs_chars, run, gpu, "--max-steps", "40") == 0
    return run


@pytest.mark.parametrize(
    "extra",
    [["--precision", "float32"], ["--precision", "bfloat16"], ["--compile"]]
    + [["--attention-window", "8", "--position", "rope"]],
    ids=["fp32", "bf16", "compile", "window"],
)
def test_training_on_the_gpu(docs_chars, tmp_path, gpu, extra, capsys):
    if extra == ["--precision", "bfloat16"] and gpu.type == "cpu":
        pytest.skip("bf16 autocast on a GPU")
    assert train(docs_chars, tmp_path / "run", gpu, "--max-steps", "30", *extra) == 0
    assert f"on {gpu.type}" in capsys.readouterr().err  # "training N parameters on cuda:0"
    trained = losses(tmp_path / "run")
    assert trained[-1] < trained[0] and all(loss == loss for loss in trained)


def test_a_gpu_run_killed_resumes_to_its_end(docs_chars, tmp_path, gpu):
    run = tmp_path / "killed"
    command = [sys.executable, "-m", "tlm", "train", "--data", str(docs_chars), "--out", str(run)]
    command += ["--device", str(gpu), *SHAPE, "--max-steps", "200", "--checkpoint-interval", "10"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    pointer, deadline = run / "train_state" / "latest", time.monotonic() + 120
    while not (pointer.is_file() and int(pointer.read_text().split("-")[1]) >= 20):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert int(latest_checkpoint(run).name.split("-")[1]) >= 20
    assert main(["train", "--out", str(run), "--resume", "--quiet"]) == 0
    assert int(latest_checkpoint(run).name.split("-")[1]) == 200
    assert all(loss == loss for loss in losses(run))  # no NaN


def assert_said(err: str, first: str) -> None:
    """A command's first stderr line names its device on a machine with a GPU (where the
    choice matters); without one (the tier's CPU dry run) no such line is written."""
    lines = err.splitlines()
    if torch.cuda.is_available():
        assert lines and lines[0].startswith(first), err
    else:
        assert not any(line.startswith(first.split(": on")[0] + ": on") for line in lines), err


def test_chat_sft_on_the_gpu_and_tlm_chat_answers(tmp_path, gpu, capsys):
    from chatting import base_and_data

    base, data = base_and_data(tmp_path)
    run = tmp_path / "chat"
    args = ["train", "--init-from", str(base), "--data", str(data.folder), "--out", str(run)]
    assert main([*args, "--max-steps", "60", "--lr", "3e-3", "--device", str(gpu), "--quiet"]) == 0
    capsys.readouterr()
    assert main(["chat", str(run), "--message", "say cat", "--device", str(gpu)]) == 0
    out = capsys.readouterr()
    assert_said(out.err, f"tlm chat: on {gpu.type}")
    assert out.out.strip()


def test_every_command_that_reads_a_model_runs_on_the_gpu(
    gpu_run, docs_chars, tmp_path, gpu, capsys
):
    run, text = str(gpu_run), tmp_path / "t.txt"
    text.write_text("The list type.")
    on_gpu = ["--device", str(gpu)]
    results = {}
    for name, device in ((gpu.type, on_gpu), ("cpu", ["--device", "cpu"])):
        assert main(["eval", run, "--text", str(text), "--json", *device]) == 0
        out = capsys.readouterr()
        assert_said(out.err, f"tlm eval: on {name}")
        results[name] = json.loads(out.out)["loss"]
    assert results[gpu.type] == pytest.approx(results["cpu"], rel=1e-4)
    greedy = ["generate", run, "--prompt", "The", "--max-new-tokens", "12"]
    assert main([*greedy, *on_gpu]) == 0
    assert main([*greedy, "--device", "cpu"]) == 0  # greedy fp32: the same text
    first, second = capsys.readouterr().out.split("\n")[:2]
    assert first == second
    commands = [
        ["generate", run, "--prompt", "The", "--do-sample", "--top-p", "0.9", "--stream"],
        ["score", run, "--context", "The", "--continuation", " list"],
        ["inspect", run, "--prompt", "The list", "--out", str(tmp_path / "page")],
        [
            "audit",
            run,
            "--data",
            str(docs_chars),
            "--samples",
            "4",
            "--prefix",
            "8",
            "--suffix",
            "8",
            "--quiet",
        ],
        ["ask", run, "What is a list?", "--max-new-tokens", "8"],
    ]
    for command in commands:
        assert main([*command, *on_gpu]) == 0, command
        assert_said(capsys.readouterr().err, f"tlm {command[0]}: on ")


def test_export_from_a_gpu_run_and_import_onto_the_gpu(gpu_run, tmp_path, gpu):
    pytest.importorskip("transformers")
    out = tmp_path / "hf"
    assert main(["export-hf", str(gpu_run), str(out)]) == 0
    ours, theirs = load_model(gpu_run, gpu), load_model(out, gpu)
    ids = torch.tensor([load_tokenizer(gpu_run).encode("The list type.")], device=gpu)
    with torch.no_grad():
        assert torch.allclose(ours(ids), theirs(ids), atol=1e-4)


def test_the_server_on_the_gpu_streams_chats_and_serves_eight_clients(gpu_run, gpu):
    pytest.importorskip("fastapi")
    from serving import KEY, post, start

    proc, url = start(gpu_run, "--device", str(gpu), "--slots", "8", "--api-key", KEY)
    try:
        body = {"model": gpu_run.name, "prompt": "The", "max_tokens": 12, "temperature": 0}
        status, first, _ = post(url + "/v1/completions", body)
        assert status == 200
        answers = [None] * 8

        def ask(i):
            answers[i] = post(url + "/v1/completions", body)[1]["choices"][0]["text"]

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert answers == [first["choices"][0]["text"]] * 8  # greedy, whatever shares the batch
        hello = [{"role": "user", "content": "hi"}]
        chat = {"model": gpu_run.name, "messages": hello, "max_tokens": 8}
        assert post(url + "/v1/chat/completions", chat)[0] == 200
        assert streamed(url, {**body, "stream": True}) == first["choices"][0]["text"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    banner = proc.stdout.read().decode().splitlines()[0]
    assert gpu.type in banner  # the first line names the device


def streamed(url: str, body: dict) -> str:
    """The text of a streamed completion, its server-sent events joined."""
    import urllib.request

    from serving import KEY

    headers = {"Authorization": f"Bearer {KEY}"}
    request = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(), headers)
    text = []
    with urllib.request.urlopen(request, timeout=60) as response:
        for line in response.read().decode().splitlines():
            if line.startswith("data: {"):
                text.append(json.loads(line[6:])["choices"][0]["text"])
    return "".join(text)


def test_both_demos_end_to_end_on_the_gpu(tmp_path, gpu, capsys):
    base, device = tmp_path / "base", ["--device", str(gpu)]
    pretrain = ["demo", "--data", str(tmp_path / "docs"), "--out", str(base), *device]
    assert main([*pretrain, "--max-steps", "40", "--vocab-size", "300", "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert f"steps on {gpu.type}" in printed and ">>> The for statement" in printed
    chat = ["demo", "chat", "--base", str(base), "--data", str(tmp_path / "qa")]
    assert main([*chat, "--out", str(tmp_path / "chat"), "--max-steps", "20", *device]) == 0
    assert "assistant stop rate" in capsys.readouterr().out
