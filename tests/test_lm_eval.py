"""lm-evaluation-harness scores `tlm serve` through its `local-completions` model: the
multiple-choice, rolling and generation requests it sends (token ids, echo with logprobs,
one token or none) come back as OpenAI's completions API answers them, and its per-sample
log-likelihoods are tlm's own."""

import inspect
import json

import pytest
import torch

from serving import KEY, TEXT, post
from tlm import load_model, load_tokenizer
from tlm.cli import main
from tlm.tasks.score import score_reference

pytestmark = pytest.mark.slow  # a server, and lm-eval's own pipeline

CHOICES = [
    {"question": "The for statement", "choices": [" runs a block", " is", " eats"], "answer": 0},
    {"question": "The while statement", "choices": [" repeats it", " sleeps"], "answer": 0},
    {"question": "User: if?\nAssistant:", "choices": [" Once.", " Again.", " It"], "answer": 0},
    {"question": "The while ", "choices": ["statement repeats it", "block"], "answer": 0},  # " s"
    {  # a seam: "The f" + "or" is "The" " for", not "The" " f" "or"
        "question": "The f",
        "choices": ["or statement runs a block", "or while it repeats", "ast and slow"],
        "answer": 0,
    },
]
TEXTS = [  # the last longer than the model's context (64): scored in windows
    {"text": "The for statement runs a block once for each item."},
    {"text": "User: for?"},
    {"text": TEXT * 4},
]

TASKS = {
    "tlm_choice": """output_type: multiple_choice
doc_to_text: "{{question}}"
doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
target_delimiter: ""
metric_list:
  - metric: acc
""",
    "tlm_rolling": """output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{text}}"
metric_list:
  - metric: word_perplexity
""",
    "tlm_generate": """output_type: generate_until
doc_to_text: "{{question}}"
doc_to_target: "{{choices[answer]}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
metric_list:
  - metric: exact_match
""",
}


@pytest.fixture(scope="module")
def tasks(tmp_path_factory, served_run):
    """The three tasks as lm-eval YAML over local JSON files, and the served model exported
    (its tokenizer is what lm-eval's huggingface tokenizer backend reads)."""
    folder = tmp_path_factory.mktemp("lm-eval")
    for name, rows in (("choice", CHOICES), ("text", TEXTS)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for task, body in TASKS.items():
        data = folder / ("text.jsonl" if task == "tlm_rolling" else "choice.jsonl")
        head = f"task: {task}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        head += f"    test: {data}\ntest_split: test\n"
        (folder / f"{task}.yaml").write_text(head + body)
    assert main(["export-hf", str(served_run), str(folder / "hf")]) == 0
    return folder


@pytest.fixture(scope="module")
def task_manager(tasks):
    """lm-eval's index of its tasks and of `tasks`: seconds to build (it reads thousands of
    task files), so built once for every evaluation in this file."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(tasks))


@pytest.fixture
def shared_index(monkeypatch, tasks, task_manager):
    """tlm's own `TaskManager(include_path=...)` gets `task_manager` when it asks for the
    index of `tasks` (anything else builds its own, as before)."""
    import lm_eval.tasks

    build = lm_eval.tasks.TaskManager

    def made(*args, **kwargs):
        if not args and kwargs == {"include_path": str(tasks)}:
            return task_manager
        return build(*args, **kwargs)

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", made)


def evaluate(server, name, tasks, task_manager, monkeypatch):
    import lm_eval

    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    args = f"base_url={server}/v1/completions,tokenizer_backend=huggingface,"
    args += f"tokenizer={tasks / 'hf'},model={name},num_concurrent=1,max_retries=1,"
    args += "max_length=65"  # context + 1: lm-eval keeps a token for generation
    return lm_eval.simple_evaluate(
        model="local-completions",
        model_args=args,
        tasks=list(TASKS),
        task_manager=task_manager,
        log_samples=True,
    )


def rolling(model, seq, N):
    """log P of seq[1:] read in windows of N tokens, each predicting N new ones (the last
    reading N tokens back): lm-eval's rolling windows, restated."""
    total, done, windows = 0.0, 1, 0
    with torch.no_grad():
        while done < len(seq):
            end = min(done + N, len(seq))  # predict seq[done:end]
            start = max(0, end - 1 - N)  # from the N tokens before end
            logprobs = model(torch.tensor([seq[start : end - 1]]))[0].log_softmax(dim=-1)
            chosen = logprobs.gather(1, torch.tensor(seq[start + 1 : end])[:, None])[:, 0]
            total, done, windows = total + float(chosen[-(end - done) :].sum()), end, windows + 1
    return total, windows


@pytest.fixture(scope="module")
def through_serve(server, served_run, tasks, task_manager):
    with pytest.MonkeyPatch.context() as monkeypatch:
        return evaluate(server, served_run.name, tasks, task_manager, monkeypatch)


def test_lm_eval_scores_tlm_serve_as_tlm_scores(server, served_run, through_serve):
    model, tokenizer = load_model(served_run), load_tokenizer(served_run)
    out = through_serve

    for sample in out["samples"]["tlm_choice"]:  # context, continuation: no <|endoftext|>
        for (context, continuation), [(logprob, greedy)] in zip(
            sample["arguments"], sample["resps"], strict=True
        ):
            stripped = context.rstrip()  # lm-eval's split: trailing spaces go with the
            context, continuation = stripped, context[len(stripped) :] + continuation  # rest,
            ctx = tokenizer.encode(context)  # the context is its own tokens,
            cont = tokenizer.encode(context + continuation)[len(ctx) :]  # then the rest's
            ids, n = torch.tensor([ctx + cont]), len(ctx)
            mine = score_reference(model, ids, n)
            assert abs(logprob - float(mine.sum())) < 1e-3
            with torch.no_grad():
                best = model(ids)[0, n - 1 : -1].argmax(dim=-1)
            assert greedy == bool((best == ids[0, n:]).all())
    accuracy = out["results"]["tlm_choice"]["acc,none"]
    assert accuracy == sum(
        max(range(len(s["resps"])), key=lambda i: s["resps"][i][0][0]) == s["target"]
        for s in out["samples"]["tlm_choice"]
    ) / len(CHOICES)

    for sample in out["samples"]["tlm_rolling"]:  # after <|endoftext|>, in windows of 63:
        scored = sample["arguments"][0][0]  # the document as the task renders it
        seq = [tokenizer.eot_id, *tokenizer.encode(scored)]  # an API model's
        mine, windows = rolling(model, seq, 63)  # request reads its window and 1 new token
        assert abs(sample["resps"][0][0] - mine) < 1e-3
    assert windows == 3  # the last document is read in three windows

    for sample in out["samples"]["tlm_generate"]:  # greedy up to a newline, from the ids
        body = {"prompt": tokenizer.encode(sample["doc"]["question"]), "max_tokens": 8}
        body |= {"temperature": 0, "stop": ["\n"]}
        status, answer, _ = post(server + "/v1/completions", body)
        assert status == 200 and sample["resps"][0][0] == answer["choices"][0]["text"]


def test_echo_returns_the_prompts_tokens_first(server, served_run):
    tokenizer, model = load_tokenizer(served_run), load_model(served_run)
    ids = tokenizer.encode("The for statement runs")
    body = {"prompt": [ids], "max_tokens": 0, "echo": True, "logprobs": 2}
    status, answer, _ = post(server + "/v1/completions", body)
    logprobs = answer["choices"][0]["logprobs"]
    assert status == 200 and answer["choices"][0]["text"] == "The for statement runs"
    assert logprobs["token_ids"] == ids and logprobs["token_logprobs"][0] is None
    mine = score_reference(model, torch.tensor([ids]), 1)
    assert torch.allclose(torch.tensor(logprobs["token_logprobs"][1:]), mine, atol=1e-4)
    assert all(len(top) == 2 for top in logprobs["top_logprobs"][1:])
    assert answer["usage"]["completion_tokens"] == 0
    assert answer["usage"]["prompt_tokens"] == len(ids)  # the ids as given, all counted

    body = {"prompt": "The for", "max_tokens": 2, "echo": True, "logprobs": 1, "temperature": 0}
    status, answer, _ = post(server + "/v1/completions", body)  # text: after <|endoftext|>
    logprobs = answer["choices"][0]["logprobs"]
    assert logprobs["tokens"][:2] == ["The", " for"] and len(logprobs["tokens"]) == 4
    ids = torch.tensor([[tokenizer.eot_id, *logprobs["token_ids"]]])
    mine = score_reference(model, ids, 1)
    assert torch.allclose(torch.tensor(logprobs["token_logprobs"]), mine, atol=1e-4)
    assert logprobs["text_offset"] == [0, 3, 7, 7 + len(logprobs["tokens"][2])]
    status, answer, _ = post(server + "/v1/completions", {"prompt": "a", "max_tokens": 0})
    assert status == 200 and answer["choices"][0]["text"] == ""  # nothing asked, nothing given


def per_sample(results):
    """{task: [(doc id, its responses)]}: loglikelihoods and is_greedy, or generated text."""
    return {
        task: [(x["doc_id"], x["resps"]) for x in sorted(samples, key=lambda x: x["doc_id"])]
        for task, samples in results["samples"].items()
    }


def assert_same(a, b, skip=()):
    for task in TASKS:
        for (doc, left), (doc_b, right) in zip(a[task], b[task], strict=True):
            assert doc == doc_b
            if (task, doc) in skip:
                continue
            for [x], [y] in zip(left, right, strict=True):
                if isinstance(x, str):
                    assert x == y, (task, doc)
                elif isinstance(x, (list, tuple)):  # (loglikelihood, is_greedy)
                    assert abs(x[0] - y[0]) < 1e-3 and bool(x[1]) == bool(y[1]), (task, doc)
                else:  # a rolling loglikelihood
                    assert abs(x - y) < 1e-3, (task, doc)


def test_tlm_lm_eval_and_the_hf_backend_agree_with_serve(
    served_run, tasks, task_manager, shared_index, through_serve, tmp_path, capsys, monkeypatch
):
    import lm_eval

    from tlm.tasks import harness

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    runs, real = [], harness.harness_evaluate

    def recorded(*args, **kwargs):  # the command's results are tlm's: one evaluation, not two
        asked = inspect.signature(real).bind(*args, **kwargs).arguments
        runs.append((asked, real(*args, **kwargs)))
        return runs[-1][1]

    monkeypatch.setattr(harness, "harness_evaluate", recorded)
    out = tmp_path / "out"
    args = ["lm-eval", str(served_run), "--tasks", ",".join(TASKS), "--include-path", str(tasks)]
    assert main([*args, "--batch-size", "2", "--output-path", str(out)]) == 0
    table = capsys.readouterr().out
    assert all(task in table for task in TASKS) and "acc" in table  # lm-eval's own table
    written = sorted(p.name.split("_20")[0] for p in out.rglob("*.json*"))
    assert written == ["results", *(f"samples_{task}" for task in sorted(TASKS))]
    [(asked, ours)] = runs
    assert asked["run"] == str(served_run) and asked["batch_size"] == 2

    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    hf_lm = HFLM(pretrained=str(tasks / "hf"), dtype="float32", batch_size=1, device="cpu")
    hf = lm_eval.simple_evaluate(
        model=hf_lm, tasks=list(TASKS), task_manager=task_manager, log_samples=True,
    )  # fmt: skip
    longer = {("tlm_rolling", 2)}  # windowed by 64 here and in hf, by 63 through an API
    assert_same(per_sample(ours), per_sample(through_serve), skip=longer)
    # lm-eval's hf backend scores requests whose context + continuation[:-1] are the same
    # tokens once: doc 3 ("The while " + "statement repeats it") is doc 1's first choice
    # split one token earlier, and doc 1's choice comes back with doc 3's split (lm-eval
    # 0.4.13). Asked alone, the hf backend gives tlm's figure.
    shared = {("tlm_choice", 1)}
    assert_same(per_sample(ours), per_sample(hf), skip=shared)
    alone = Instance("loglikelihood", {}, ("The while statement", " repeats it"), 0)
    first_choice = per_sample(ours)["tlm_choice"][1][1][0][0]
    assert abs(hf_lm.loglikelihood([alone])[0][0] - first_choice[0]) < 1e-3
    long = next(x for x in ours["samples"]["tlm_rolling"] if x["doc_id"] == 2)
    tokenizer = load_tokenizer(served_run)
    seq = [tokenizer.eot_id, *tokenizer.encode(long["arguments"][0][0])]
    rolled = long["resps"][0][0]
    assert abs(rolled - rolling(load_model(served_run), seq, 64)[0]) < 1e-3
    for task in TASKS:  # perplexities (~16) are exp of a mean: fp32 agrees to ~1e-7 relative
        mine, theirs = ours["results"][task], hf["results"][task]
        assert mine.keys() == theirs.keys()
        for key, value in theirs.items():
            close = pytest.approx(value, rel=1e-6, abs=1e-6) if isinstance(value, float) else value
            assert mine[key] == close, (task, key)


def test_tlm_lm_eval_refuses_in_one_line(served_run, tasks, shared_index, capsys, monkeypatch):
    args = ["lm-eval", str(served_run), "--tasks", "no_such_task", "--include-path", str(tasks)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "no task 'no_such_task'" in err and len(err.strip().splitlines()) == 1
    import builtins

    real = builtins.__import__

    def without_lm_eval(name, *args, **kwargs):
        if name.startswith("lm_eval"):
            raise ImportError(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", without_lm_eval)
    assert main(["lm-eval", str(served_run), "--tasks", "x"]) == 2
    assert 'pip install "tlm[eval]"' in capsys.readouterr().err


def test_registering_tlm_keeps_lm_evals_own_models():
    """lm-eval fills its model registry on first use only while it is empty: registering
    `tlm` first must not hide `hf` or `local-completions` (a fresh process)."""
    import subprocess
    import sys

    code = "import tlm.tasks.harness; from lm_eval.api.registry import get_model; "
    code += "print(get_model('tlm').__name__, get_model('hf').__name__)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.split() == ["TlmLM", "HFLM"], done.stderr


def test_lm_eval_reads_the_servers_own_tokenizer(server, served_run, task_manager, through_serve):
    """With tokenizer_backend auto, lm-eval finds /tokenizer_info, /tokenize and /detokenize
    and needs no exported tokenizer: the same per-sample results."""
    import lm_eval

    args = f"base_url={server}/v1/completions,tokenizer_backend=auto,auth_token={KEY},"
    args += f"model={served_run.name},num_concurrent=1,max_retries=1,max_length=65"
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv("OPENAI_API_KEY", KEY)
        monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
        remote = lm_eval.simple_evaluate(
            model="local-completions", model_args=args, tasks=list(TASKS),
            task_manager=task_manager, log_samples=True,
        )  # fmt: skip
    assert_same(per_sample(remote), per_sample(through_serve))
    status, answer, _ = post(server + "/tokenize", {"prompt": "The", "add_special_tokens": False})
    assert answer["tokens"] == load_tokenizer(served_run).encode("The")
    status, answer, _ = post(server + "/detokenize", {"tokens": answer["tokens"]})
    assert status == 200 and answer["prompt"] == "The"


def test_a_character_model_scores_what_it_can_spell(docs_chars, tmp_path):
    """A character lm-eval request with a character the corpus never held: a continuation or
    document is impossible (-inf), a context or prompt is read without it."""
    import math

    from lm_eval.api.instance import Instance

    from conftest import varied_char_run
    from tlm.tasks.harness import TlmLM

    lm = TlmLM(str(varied_char_run(docs_chars, tmp_path / "run")))

    def ask(kind, *args):
        return Instance(request_type=kind, doc={}, arguments=args, idx=0)

    snow = "\u2603"  # not in the Python documentation
    plain, unseen, seen_around = lm.loglikelihood(
        [
            ask("loglikelihood", "The for", " statement"),
            ask("loglikelihood", "The for", f" st{snow}"),
            ask("loglikelihood", f"The {snow}for", " statement"),
        ]
    )
    assert unseen == (-math.inf, False)
    assert seen_around == plain and math.isfinite(plain[0])
    whole, impossible = lm.loglikelihood_rolling(
        [ask("loglikelihood_rolling", "The for statement"), ask("loglikelihood_rolling", snow)]
    )
    assert math.isfinite(whole) and impossible == -math.inf
    settings = {"until": ["\n"], "max_gen_toks": 6}
    texts = lm.generate_until(
        [
            ask("generate_until", f"{snow}The for", settings),
            ask("generate_until", "The for", settings),
        ]
    )
    assert texts[0] == texts[1]
