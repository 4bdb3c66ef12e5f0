"""lm-evaluation-harness scores `tlm serve` through its `local-completions` model: the
multiple-choice, rolling and generation requests it sends (token ids, echo with logprobs,
one token or none) come back as OpenAI's completions API answers them, and its per-sample
log-likelihoods are tlm's own."""

import json

import pytest
import torch

from serving import KEY, post
from tlm import load_model, load_tokenizer
from tlm.cli import main
from tlm.tasks.score import score_reference

pytestmark = pytest.mark.slow  # a server, and lm-eval's own pipeline

CHOICES = [
    {"question": "The for statement", "choices": [" runs a block", " is", " eats"], "answer": 0},
    {"question": "The while statement", "choices": [" repeats it", " sleeps"], "answer": 0},
    {"question": "User: if?\nAssistant:", "choices": [" Once.", " Again.", " It"], "answer": 0},
]
TEXTS = [{"text": "The for statement runs a block once for each item."}, {"text": "User: for?"}]

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


def evaluate(server, name, tasks, monkeypatch):
    import lm_eval
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    args = f"base_url={server}/v1/completions,tokenizer_backend=huggingface,"
    args += f"tokenizer={tasks / 'hf'},model={name},num_concurrent=1,max_retries=1"
    return lm_eval.simple_evaluate(
        model="local-completions",
        model_args=args,
        tasks=list(TASKS),
        task_manager=TaskManager(include_path=str(tasks)),
        log_samples=True,
    )


def test_lm_eval_scores_tlm_serve_as_tlm_scores(server, served_run, tasks, monkeypatch):
    model, tokenizer = load_model(served_run), load_tokenizer(served_run)
    out = evaluate(server, served_run.name, tasks, monkeypatch)

    for sample in out["samples"]["tlm_choice"]:  # context, continuation: no <|endoftext|>
        for (context, continuation), [(logprob, greedy)] in zip(
            sample["arguments"], sample["resps"], strict=True
        ):
            whole, n = tokenizer.encode(context + continuation), len(tokenizer.encode(context))
            ids = torch.tensor([whole])
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

    for sample in out["samples"]["tlm_rolling"]:  # a document after <|endoftext|>, as eval reads it
        ids = torch.tensor([[tokenizer.eot_id, *tokenizer.encode(sample["doc"]["text"])]])
        assert abs(sample["resps"][0][0] - float(score_reference(model, ids, 1).sum())) < 1e-3

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

    body = {"prompt": "The for", "max_tokens": 2, "echo": True, "logprobs": 1, "temperature": 0}
    status, answer, _ = post(server + "/v1/completions", body)  # text: after <|endoftext|>
    logprobs = answer["choices"][0]["logprobs"]
    assert logprobs["tokens"][:2] == ["The", " for"] and len(logprobs["tokens"]) == 4
    ids = torch.tensor([[tokenizer.eot_id, *logprobs["token_ids"]]])
    mine = score_reference(model, ids, 1)
    assert torch.allclose(torch.tensor(logprobs["token_logprobs"]), mine, atol=1e-4)
    assert logprobs["text_offset"] == [0, 3, 7, 7 + len(logprobs["tokens"][2])]
    status, answer, _ = post(server + "/v1/completions", {"prompt": "a", "max_tokens": 0})
    assert status == 400 and answer["error"]["param"] == "max_tokens"  # 0 only with echo
