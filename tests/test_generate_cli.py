"""Text in, text out: prompts, stop strings, streaming, and the `tlm generate` command."""

import json

import pytest
import torch

from tlm import load_model, load_tokenizer
from tlm.cli import main
from tlm.generate import GenerationConfig, complete, encode_prompts, stream_completion


@pytest.fixture(scope="module")
def run(docs_chars, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "tiny"
    args = ["train", "--data", str(docs_chars), "--out", str(out), "--n-layers", "2"]
    args += ["--d-model", "32", "--n-heads", "2", "--context-length", "32", "--max-steps", "60"]
    assert main([*args, "--batch-size", "16", "--quiet"]) == 0
    return out


def test_prompts_are_left_padded_after_endoftext(run):
    tok = load_tokenizer(run)
    ids, mask = encode_prompts(tok, ["ab", "abcd", ""], 32)
    assert ids.shape == (3, 5) and ids[:, -1].tolist() == [
        *tok.encode("b"),
        *tok.encode("d"),
        tok.eot_id,
    ]
    assert mask.tolist() == [[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1]]
    told = []
    ids, mask = encode_prompts(tok, ["x" * 50], 32, lambda *a: told.append(a))
    assert ids.shape == (1, 32) and mask is None and told == [(0, 51, 32)]


def test_stop_strings_cut_the_text_and_streaming_matches(run):
    model, tok = load_model(run), load_tokenizer(run)
    config = GenerationConfig(max_new_tokens=60, do_sample=True, seed=4, eos_token_id=tok.eot_id)
    (free,) = complete(model, tok, ["The "], config)
    stop = free.text[10:12]  # a string this sample is known to produce
    (cut,) = complete(model, tok, ["The "], config, stop=(stop,))
    assert cut.finish_reason == "stop" and stop not in cut.text
    assert free.text.startswith(cut.text) and len(cut.text) == free.text.index(stop)
    assert "".join(stream_completion(model, tok, "The ", config, (stop,))) == cut.text
    assert "".join(stream_completion(model, tok, "The ", config)) == free.text


def test_generate_command_json(run, capsys):
    args = ["generate", str(run), "--prompt", "The", "--prompt", "A", "--do-sample", "-n", "2"]
    assert main([*args, "--seed", "1", "--max-new-tokens", "12", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)["completions"]
    assert [c["prompt"] for c in out] == ["The", "The", "A", "A"]
    for c in out:
        assert len(c["tokens"]) == len(c["logprobs"]) <= 12 and c["finish_reason"] in (
            "length",
            "eos",
        )
        assert all(lp <= 0 for lp in c["logprobs"])


def test_generate_command_streams_and_reads_prompt_files(run, tmp_path, capsys):
    assert (
        main(["generate", str(run), "--prompt", "The", "--max-new-tokens", "20", "--stream"]) == 0
    )
    streamed = capsys.readouterr().out
    assert main(["generate", str(run), "--prompt", "The", "--max-new-tokens", "20"]) == 0
    assert capsys.readouterr().out == streamed and streamed.startswith("The")
    prompt = tmp_path / "p.txt"
    prompt.write_text("x" * 40)
    assert main(["generate", str(run), "--prompt-file", str(prompt), "--max-new-tokens", "3"]) == 0
    assert "prompt 1 has 41 tokens; keeping the last 32" in capsys.readouterr().err
    assert (
        main(["generate", str(run), "--max-new-tokens", "5"]) == 0
    )  # no prompt: after <|endoftext|>


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "int8"])
def test_generate_command_other_weight_formats(run, capsys, dtype):
    assert (
        main(["generate", str(run), "--prompt", "The", "--max-new-tokens", "8", "--dtype", dtype])
        == 0
    )
    assert capsys.readouterr().out.startswith("The")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--do-sample", "--top-p", "0"], "top_p must be in (0, 1], got 0.0"),
        (["--do-sample", "--top-k", "0"], "top_k must be >= 1, got 0"),
        (["--do-sample", "--temperature", "-1"], "temperature must be >= 0, got -1.0"),
        (["--num-beams", "0"], "num_beams must be >= 1, got 0"),
        (["--max-new-tokens", "-1"], "max_new_tokens must be >= 0, got -1"),
        (["--temperature", "0.5"], "--temperature applies to sampling: add --do-sample"),
        (["--prompt-file", "missing.txt"], "missing.txt: no such file"),
        (["-n", "2", "--stream"], "--stream shows one completion"),
    ],
)
def test_generate_command_errors(run, capsys, args, message):
    assert main(["generate", str(run), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tlm: error:") and message in err and err.count("\n") == 1


def test_prompt_logprobs_score_every_prompt_token(run, capsys):
    args = ["generate", str(run), "--prompt", "The cat", "--prompt", "A", "--max-new-tokens", "2"]
    assert main([*args, "--json", "--prompt-logprobs"]) == 0
    first, second = json.loads(capsys.readouterr().out)["completions"]
    model, tok = load_model(run), load_tokenizer(run)
    ids = torch.tensor([[tok.eot_id, *tok.encode("The cat")]])
    expected = model(ids[:, :-1]).log_softmax(-1)[0].gather(1, ids[0, 1:, None])[:, 0]
    assert first["prompt_tokens"] == tok.encode("The cat")
    assert first["prompt_logprobs"] == pytest.approx(expected.tolist(), abs=1e-4)
    assert second["prompt_tokens"] == tok.encode("A") and len(second["prompt_logprobs"]) == 1


def test_stop_strings_keep_escapes_and_any_character():
    from tlm.cli.generate import _unescape

    assert _unescape("\\n") == "\n" and _unescape("é\\n") == "é\n" and _unescape("中") == "中"
