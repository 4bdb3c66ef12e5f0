"""What the server and page tests share: a small served model, a server process on a
loopback port, and requests to it."""

import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from tlm.cli import main
from tlm.generate import GenerationConfig, complete
from tlm.inference import for_inference
from tlm.load import load_model, load_tokenizer

KEY = "test-key"
# seconds a server gets to free its rows or its queue: far more than a loaded 2-core host
# needs, far less than the million tokens the requests of these tests ask for would take
SETTLE = 60
ARTIFACTS = Path(__file__).resolve().parents[1] / "out" / "test-artifacts"  # screenshots
CHAT = (  # three turns: the model learns to write "\nUser:" after a reply
    "System: Be brief.\nUser: for?\nAssistant: It runs a block.\nUser: while?\nAssistant: Again."
    "\nUser: if?\nAssistant: Once."
)
TEXT = "The for statement runs a block once for each item. The while statement repeats it.\n\n"


def train_run(folder: Path) -> Path:
    """A 2-layer model of two documents (prose and a chat) that learns to end them."""
    corpus = folder / "corpus.jsonl"  # 400 documents: the model learns to end one
    docs = [TEXT.strip(), CHAT] * 200
    corpus.write_text("".join(json.dumps({"text": doc}) + "\n" for doc in docs))
    data, run = folder / "data", folder / "run"
    assert main(["prepare", str(corpus), "--out", str(data), "--vocab-size", "300", "--quiet"]) == 0
    args = ["train", "--data", str(data), "--out", str(run), "--n-layers", "2", "--d-model", "32"]
    args += ["--n-heads", "2", "--context-length", "64", "--max-steps", "300", "--batch-size", "8"]
    assert main([*args, "--quiet"]) == 0
    return run


def start(run, *extra):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "tlm", "serve", str(run), "--port", str(port), *extra]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(url + "/health", timeout=1)
            return proc, url
        except OSError:
            assert proc.poll() is None, proc.stdout.read().decode()
            assert time.monotonic() < deadline
            time.sleep(0.1)


def local(run, prompt, max_tokens, stop=(), **settings):
    model, tokenizer = for_inference(load_model(run), "float32"), load_tokenizer(run)
    config = GenerationConfig(max_new_tokens=max_tokens, eos_token_id=tokenizer.eot_id, **settings)
    return complete(model, tokenizer, [prompt], config, stop)[0]


def post(url, body, key=KEY, raw=None):
    data = raw if raw is not None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read()), response.headers
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read()), error.headers


def health(url):
    with urllib.request.urlopen(url + "/health", timeout=5) as response:
        return json.loads(response.read())


def eventually(condition, within: float = SETTLE) -> bool:
    """Whether `condition()` holds within `within` seconds (asked every 50 ms)."""
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True
