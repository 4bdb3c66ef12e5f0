"""Shared fixtures: tiny models (2 layers, d=64) that run in milliseconds on a CPU."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
import torch

from budget import share_out_threads
from tlm import ModelConfig, TransformerLM
from tlm.inference import native

pytest_plugins = ["budget"]  # the suite's time, reported against its budget (budget.py)
share_out_threads()  # under `make test`'s workers: each its share of the cores

POSITIONS = ["learned", "sinusoidal", "rope", "none"]
NORMS = ["pre", "post"]
V = 300  # the vocabulary of the Hugging Face interop fixtures


def written_out(module):
    """Listen to every attention pattern of `module` (a model or one attention), so each of
    its forward passes takes the written-out path (eq. 9.11-9.13) instead of the fused one."""
    from tlm.model.attention import MultiHeadAttention

    for m in module.modules():
        if isinstance(m, MultiHeadAttention):
            m.pattern.register_forward_hook(lambda *_: None)
    return module


def tiny_config(**overrides) -> ModelConfig:
    values = dict(vocab_size=97, d_model=64, n_layers=2, n_heads=4, context_length=32)
    values.update(overrides)
    return ModelConfig(**values)


def save_run(folder, model, tokenizer):
    """Write `model` and `tokenizer` as a run directory that `tlm.load_model` reads."""
    from tlm.checkpoint import save_weights, write_config

    folder.mkdir(parents=True, exist_ok=True)
    save_weights(folder / "model.safetensors", model)
    write_config(folder, model.config, {})
    tokenizer.save(folder / "tokenizer.json")
    return folder


def varied_char_run(corpus, folder, **overrides):
    """A run of a random model on `corpus`'s characters whose weights are N(0, 0.3) (norm
    gains N(1, 0.3)): attention patterns and predictions that vary with the context."""
    from tlm import load_tokenizer

    tokenizer = load_tokenizer(corpus)
    torch.manual_seed(0)
    model = TransformerLM(tiny_config(vocab_size=tokenizer.vocab_size, **overrides))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if name.endswith("gamma") else 0.0, 0.3)
    return save_run(folder, model, tokenizer)


@pytest.fixture(params=native.builds_here())
def kernel_build(request, monkeypatch):
    """Each build of tlm's C kernels this host can run, in turn (`native.builds_here`: on an
    AVX-512 host its own kernels and haswell's AVX2 ones): a test that takes it runs once per
    instruction set, wherever `native.library()` is asked (subprocesses inherit it)."""
    monkeypatch.setenv("TLM_NATIVE_ARCH", request.param)
    return request.param


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def each_thread_count(request):
    """The test at one thread and at two, whatever the suite runs at (`make test`'s workers
    run one thread each on two cores): the kernels share rows out among torch's threads,
    so a module of kernel tests takes this (`pytestmark`) to run both ways on every host."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def gpu() -> torch.device:
    """The device of the CUDA tier (tests marked `cuda`, `make test-gpu`): the first GPU, the
    test skipped without one. TLM_TIER_DEVICE=cpu runs the tier on the CPU instead, to check
    the tier itself on a host without a GPU."""
    name = os.environ.get("TLM_TIER_DEVICE")
    if name:
        return torch.device(name)
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (the CUDA tier: make test-gpu)")
    return torch.device("cuda")


@pytest.fixture
def make_model():
    """A factory: make_model(**config overrides) -> TransformerLM in eval mode, seeded."""

    def make(seed: int = 0, **overrides) -> TransformerLM:
        torch.manual_seed(seed)
        model = TransformerLM(tiny_config(**overrides))
        return model.eval()

    return make


@pytest.fixture(scope="session")
def docs_chars(tmp_path_factory):
    """The built-in python-docs corpus prepared with the char tokenizer, once per session."""
    from tlm.data import prepare

    folder = tmp_path_factory.mktemp("data") / "python-docs"
    prepare(["python-docs"], folder, tokenizer="char", progress=False)
    return folder


def assert_same_logits(hf, model, lengths=(1, 13, 32), batch=3, seed=4):
    """A `transformers` model's logits equal tlm's (1e-4) on random ids of a few lengths."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for T in lengths:
            ids = torch.randint(0, V, (batch, T))
            assert torch.allclose(hf(ids).logits, model(ids), atol=1e-4, rtol=0)


def hf_model(**overrides):
    """A random GPT2LMHeadModel of a small GPT2Config (no network), eval mode."""
    values = dict(vocab_size=V, n_positions=64, n_embd=32, n_layer=2, n_head=4)
    values.update(overrides)
    import transformers

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**values)).eval()
    with torch.no_grad():  # GPT-2 initialises biases and LayerNorms to 0 and 1: perturb them
        for name, param in model.named_parameters():
            if name.endswith("bias") or ".ln_" in name:
                param.add_(0.1 * torch.randn_like(param))
    return model


@pytest.fixture(scope="session")
def gpt2_files(tmp_path_factory, bpe_tokenizer):
    """GPT-2's original tokenizer files (vocab.json + merges.txt) of a 300-token BPE."""
    folder = tmp_path_factory.mktemp("gpt2_tokenizer")
    bpe_tokenizer.tokenizer.model.save(str(folder))
    return folder


@pytest.fixture(scope="session")
def bpe_tokenizer():
    from pydoc_data.topics import topics

    from tlm.tokenizer import train_tokenizer

    return train_tokenizer("bpe", list(topics.values())[:200], V)


@pytest.fixture(scope="session")
def gpt2_dir(tmp_path_factory, gpt2_files):
    """A Hugging Face GPT-2 directory (`save_pretrained`) with GPT-2's tokenizer files."""
    folder = tmp_path_factory.mktemp("hf") / "gpt2"
    hf_model().save_pretrained(folder)
    for name in ("vocab.json", "merges.txt"):
        (folder / name).write_bytes((gpt2_files / name).read_bytes())
    return folder


CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")


@pytest.fixture(scope="session")
def browser():
    if not (CHROMIUM and DRIVER):
        pytest.skip(
            "Debian's chromium and chromium-driver are not installed (.ci/run installs them)"
        )
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-sync",
        "--disable-component-update",
        "--window-size=1400,1000",
    ):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)  # no download
    yield driver
    driver.quit()


def console_errors(driver) -> list[str]:
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]


@pytest.fixture(scope="session")
def served_run(tmp_path_factory):
    """The small model the server and page tests serve (`serving.train_run`)."""
    from serving import train_run

    return train_run(tmp_path_factory.mktemp("serve"))


@pytest.fixture(scope="session")
def server(served_run):
    """`tlm serve` of `served_run` on a loopback port, with the key `serving.KEY`."""
    from serving import KEY, start

    proc, url = start(served_run, "--slots", "4", "--max-queue", "64", "--api-key", KEY)
    yield url
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:  # never leave a server decoding behind the suite
        proc.kill()
        proc.wait(timeout=10)
        raise


WORDS = ["python", "module", "import", "string", "object", "return"]


@pytest.fixture(scope="session")
def words_data(tmp_path_factory):
    """Characters of random words from WORDS: a masked letter is given by its neighbours on
    both sides, and the most frequent character is 1/5 of them at most."""
    folder = tmp_path_factory.mktemp("words")
    rng = torch.Generator().manual_seed(0)
    picks = torch.randint(0, len(WORDS), (12_000,), generator=rng).tolist()
    (folder / "words.txt").write_text(" ".join(WORDS[i] for i in picks))
    from tlm.data import prepare

    prepare([str(folder / "words.txt")], folder / "data", tokenizer="char", progress=False)
    return folder / "data"


@pytest.fixture(scope="session")
def words_mlm(tmp_path_factory, words_data):
    """A masked-LM encoder pretrained on `words_data` (200 steps, ~5 s)."""
    from tlm.cli import main

    run = tmp_path_factory.mktemp("mlm") / "run"
    args = ["train", "--objective", "mlm", "--data", str(words_data), "--out", str(run)]
    args += ["--d-model", "64", "--n-layers", "2", "--n-heads", "4", "--context-length", "32"]
    args += ["--batch-size", "16", "--max-steps", "200", "--lr", "3e-3", "--warmup-steps", "10"]
    args += ["--position", "rope", "--norm", "pre"]  # learned positions learn it 10x slower
    assert main([*args, "--eval-interval", "100", "--eval-tokens", "4096", "--quiet"]) == 0
    return run
