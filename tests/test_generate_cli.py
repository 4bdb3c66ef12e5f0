"""Text in, text out: prompts, stop strings, streaming, and the `tlm generate` command."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tlm import load_model, load_tokenizer
from tlm.cli import main
from tlm.generate import GenerationConfig, complete, encode_prompts, stream_completion
from tlm.inference import check_format, for_inference
from tlm.tokenizer import InputTooLong

TOL = 1e-6  # the CLI and the library run the same kernels: their log-probs agree to rounding


@pytest.fixture(scope="module")
def run(docs_chars, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "tiny"
    args = ["train", "--data", str(docs_chars), "--out", str(out), "--n-layers", "2"]
    args += ["--d-model", "32", "--n-heads", "2", "--context-length", "32", "--max-steps", "60"]
    assert main([*args, "--batch-size", "16", "--quiet"]) == 0
    return out


@pytest.mark.slow
def test_prompts_are_left_padded_after_endoftext(run):
    tok = load_tokenizer(run)
    ids, mask = encode_prompts(tok, ["ab", "abcd", ""], 32)
    assert ids.shape == (3, 5) and ids[:, -1].tolist() == [
        *tok.encode("b"),
        *tok.encode("d"),
        tok.eot_id,
    ]
    assert mask.tolist() == [[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1]]
    with pytest.raises(InputTooLong, match="^prompt 2 has 51 tokens; the model reads at most 32$"):
        encode_prompts(tok, ["x", "x" * 50], 32)


def test_stop_strings_cut_the_text_and_streaming_matches(run):
    model, tok = load_model(run), load_tokenizer(run)
    config = GenerationConfig(max_new_tokens=60, do_sample=True, seed=4, eos_token_id=tok.eot_id)
    (free,) = complete(model, tok, ["The "], config)
    middle = len(free.text) // 2
    assert middle >= 2
    stop = free.text[middle : middle + 2]  # a string this sample is known to produce
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
    prompt.write_text("The ")
    assert main(["generate", str(run), "--prompt-file", str(prompt), "--max-new-tokens", "3"]) == 0
    assert capsys.readouterr().out.startswith("The ")
    prompt.write_text("x" * 40)  # too long: refused, as by every command (tokenizer.within)
    assert main(["generate", str(run), "--prompt-file", str(prompt), "--max-new-tokens", "3"]) == 2
    assert "prompt 1 has 41 tokens; the model reads at most 32" in capsys.readouterr().err
    assert (
        main(["generate", str(run), "--max-new-tokens", "5"]) == 0
    )  # no prompt: after <|endoftext|>


@pytest.fixture(scope="module")
def end_biased(run, tmp_path_factory):
    """Copies of the run leaning towards <|endoftext|>: end_biased(s) adds s to its logit.

    The head is tied (logits = h E^T), so shifting the final LayerNorm's beta by
    s E[eot] / |E[eot]|^2 adds s to the end token's logit and s cos(E[v], E[eot]) |E[v]| /
    |E[eot]| to every other token's: the end token gains the most.
    """
    eot = load_tokenizer(run).eot_id
    weights = load_file(str(run / "model.safetensors"))
    E_eot = weights["embedding.E"][eot]
    made = {}

    def make(scale: float):
        if scale not in made:
            out = tmp_path_factory.mktemp("end_biased") / "run"
            shutil.copytree(run, out)
            beta = weights["ln_f.beta"] + scale * E_eot / E_eot.norm() ** 2
            save_file({**weights, "ln_f.beta": beta}, str(out / "model.safetensors"))
            made[scale] = out
        return made[scale]

    return make


def generated(capsys, run, *args):
    """The completions `tlm generate RUN ARGS --json` prints."""
    assert main(["generate", str(run), *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)["completions"]


def library(run, prompt, dtype="float32", prompt_logprobs=False, **settings):
    """What the CLI should print: the library's completion with the config the CLI builds."""
    tok = load_tokenizer(run)
    config = GenerationConfig(eos_token_id=tok.eot_id, **settings)
    model = load_model(run, dtype=dtype)
    (completion,) = complete(model, tok, [prompt], config, prompt_logprobs=prompt_logprobs)
    return completion


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "int8", "q8_0", "q4_0", "q4_k"])
def test_generate_command_other_weight_formats(run, capsys, dtype):
    """--dtype reaches the model: the CLI scores as the library does in that format, and the
    format's scores differ from float32's by far more than the tolerance."""
    prompt = "The for statement iterates over"  # 31 tokens with <|endoftext|>: the context fits
    args = ["--prompt", prompt, "--max-new-tokens", "8", "--prompt-logprobs"]
    (printed,) = generated(capsys, run, *args, "--dtype", dtype)
    expected = library(run, prompt, dtype, prompt_logprobs=True, max_new_tokens=8)
    float32 = library(run, prompt, "float32", prompt_logprobs=True, max_new_tokens=8)
    assert printed["tokens"] == expected.tokens and printed["finish_reason"] == "length"
    assert printed["prompt_tokens"] == expected.prompt_tokens
    scores = printed["prompt_logprobs"] + printed["logprobs"]
    assert scores == pytest.approx(expected.prompt_logprobs + expected.logprobs, abs=TOL)
    apart = torch.tensor(float32.prompt_logprobs) - torch.tensor(expected.prompt_logprobs)
    assert apart.abs().max() > 10 * TOL


def test_int8_runs_on_the_cpu_only(run):
    with pytest.raises(ValueError, match="^int8 inference runs on the CPU only$"):
        check_format("int8", torch.device("cuda"))  # decided from the device: no GPU needed
    check_format("int8", torch.device("cpu"))
    ids = torch.randint(0, 100, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        exact, packed = load_model(run)(ids), for_inference(load_model(run), "int8")(ids)
    error = (packed - exact).abs().max() / exact.abs().max()
    assert 0 < error < 0.05  # int8 weights: close to float32, not equal


def test_no_eos_generates_through_the_end_token(end_biased, capsys):
    run = end_biased(1000.0)  # <|endoftext|> is the greedy choice at every step
    eot = load_tokenizer(run).eot_id
    args = ["--prompt", "The", "--max-new-tokens", "6"]
    (stopped,) = generated(capsys, run, *args)
    assert stopped["tokens"] == [] and stopped["finish_reason"] == "eos"
    (through,) = generated(capsys, run, *args, "--no-eos")
    assert len(through["tokens"]) == 6 and through["finish_reason"] == "length"
    assert eot in through["tokens"] and "<|endoftext|>" in through["text"]


def test_generate_command_passes_the_length_penalty(end_biased, capsys):
    """Beam search ranks finished hypotheses by log P / length^length_penalty: find an end
    bias at which 0 and 2 choose different ones, then the CLI must choose as the library."""
    settings = dict(max_new_tokens=16, num_beams=4)
    for scale in (0.0, 1.0, 2.0, 4.0):
        run = end_biased(scale)
        expected = {p: library(run, "The", length_penalty=p, **settings) for p in (0.0, 2.0)}
        if expected[0.0].tokens != expected[2.0].tokens:
            break
    else:
        pytest.fail("no end bias at which the length penalty changes the beam's choice")
    for penalty, completion in expected.items():
        args = ["--prompt", "The", "--max-new-tokens", "16", "--num-beams", "4"]
        (printed,) = generated(capsys, run, *args, "--length-penalty", str(penalty))
        assert printed["tokens"] == completion.tokens
        assert printed["finish_reason"] == completion.finish_reason


def test_generate_command_passes_the_repetition_penalty(run, capsys):
    expected = {p: library(run, "The", max_new_tokens=16, repetition_penalty=p) for p in (1, 3)}
    assert expected[1].tokens != expected[3].tokens
    for penalty, completion in expected.items():
        args = ["--prompt", "The", "--max-new-tokens", "16", "--repetition-penalty", str(penalty)]
        (printed,) = generated(capsys, run, *args)
        assert printed["tokens"] == completion.tokens
        assert printed["logprobs"] == pytest.approx(completion.logprobs, abs=TOL)


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


def test_beam_search_json_gives_each_tokens_logprob(run, capsys):
    """`--num-beams` with `--json`: one log-probability per generated token, the model's."""
    (beam,) = generated(
        capsys, run, "--prompt", "The ", "--num-beams", "3", "--max-new-tokens", "8"
    )
    assert len(beam["logprobs"]) == len(beam["tokens"]) > 0
    model, tok = load_model(run), load_tokenizer(run)
    ids = torch.tensor([[tok.eot_id, *tok.encode("The "), *beam["tokens"]]])
    n = len(beam["tokens"])
    with torch.no_grad():
        logp = model(ids[:, :-1]).log_softmax(-1)[0, -n:].gather(1, ids[0, -n:, None])[:, 0]
    assert beam["logprobs"] == pytest.approx(logp.tolist(), abs=1e-4)


def test_eval_and_score_take_the_weight_formats(run, capsys, tmp_path):
    """`tlm eval --dtype` and `tlm score --dtype` read the run in that format: figures near
    float32's, not equal; a task that reads float32 refuses it in one line."""
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 20)
    figures = {}
    for dtype in (None, "q4_0"):
        flags = [] if dtype is None else ["--dtype", dtype]
        assert main(["eval", str(run), "--text", str(text), "--json", *flags]) == 0
        loss = json.loads(capsys.readouterr().out)["loss"]
        assert (
            main(
                ["score", str(run), "--context", "The", "--continuation", " fox", "--json", *flags]
            )
            == 0
        )
        logprob = json.loads(capsys.readouterr().out)["continuations"][0]["logprob"]
        figures[dtype] = (loss, logprob)
    (loss, logprob), (q_loss, q_logprob) = figures[None], figures["q4_0"]
    assert loss != q_loss and abs(q_loss - loss) < 0.05 * loss
    assert logprob != q_logprob and abs(q_logprob - logprob) < 0.5
    assert main(["eval", str(run), "--task", "translate", "--dtype", "int8"]) != 0
    assert "--dtype goes with --task lm, verify and chat" in capsys.readouterr().err
