"""One conversion from a request to the decoding settings: the same settings given as
`tlm generate` flags, as `model.generate` keywords and as an OpenAI body decode the same
tokens (greedy, with penalties and a logit bias, which change the choice)."""

import json

import pytest

from serving import post
from tlm.cli import main
from tlm.load import load_model, load_tokenizer
from tlm.tokenizer import document_ids

pytestmark = pytest.mark.slow  # the served model and its server

PROMPT = "The for"


def test_the_cli_python_and_http_decode_the_same_tokens(served_run, server, capsys):
    tokenizer = load_tokenizer(served_run)
    ids = document_ids(tokenizer, PROMPT)
    favoured = tokenizer.encode(" while")[0]
    flags = ["--max-new-tokens", "12", "--repetition-penalty", "1.3"]
    flags += ["--frequency-penalty", "0.5", "--logit-bias", f"{favoured}:3", "--no-eos"]
    assert main(["generate", str(served_run), "--prompt", PROMPT, *flags, "--json"]) == 0
    cli = json.loads(capsys.readouterr().out)["completions"][0]["tokens"]

    import torch

    model = load_model(served_run).eval()
    python = model.generate(
        torch.tensor([ids]), max_new_tokens=12, repetition_penalty=1.3, frequency_penalty=0.5,
        logit_bias={favoured: 3.0},
    )[0, len(ids) :].tolist()  # fmt: skip

    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "logprobs": 0}
    body |= {"repetition_penalty": 1.3, "frequency_penalty": 0.5, "ignore_eos": True}
    body["logit_bias"] = {str(favoured): 3}
    status, answer, _ = post(server + "/v1/completions", body)
    http = answer["choices"][0]["logprobs"]["token_ids"]
    assert status == 200 and len(cli) == 12
    assert cli == python == http
    plain = model.generate(torch.tensor([ids]), max_new_tokens=12)[0, len(ids) :].tolist()
    assert plain != cli  # the settings changed the choice: the test can tell them apart
