"""Structured outputs: a random model held to a JSON schema, a regular expression or a Lark
grammar writes only valid text; the mask comes before every other step of the choice; the
cached loop equals the reference loop; errors are one line."""

import json
import re
import sys
import urllib.request

import jsonschema_rs
import pytest
import torch

from conftest import save_run, tiny_config
from serving import KEY, local, post
from tlm import TransformerLM
from tlm.cli import main
from tlm.generate import GenerationConfig, GenerationError, complete
from tlm.generate.constrain import Grammar
from tlm.load import load_tokenizer
from tlm.tokenizer import CharTokenizer

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "colour": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
        "home": {
            "type": "object",
            "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "maximum": 9}},
            "required": ["ok"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "colour", "tags", "home"],
    "additionalProperties": False,
}
STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"')  # a JSON string literal


def random_model(vocab_size: int, seed: int = 0) -> TransformerLM:
    """Weights N(0, 0.3): predictions that vary with the context, and no wish for JSON."""
    torch.manual_seed(seed)
    model = TransformerLM(tiny_config(vocab_size=vocab_size, context_length=256))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if name.endswith("gamma") else 0.0, 0.3)
    return model.eval()


def settings(tokenizer, **more) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=200, eos_token_id=tokenizer.eot_id, **more)


@pytest.mark.parametrize("temperature", [0.0, 1.0, 3.0])
def test_a_random_model_writes_valid_compact_json(bpe_tokenizer, temperature):
    """Bounded values (maxLength, minimum/maximum, enum, maxItems): every answer ends by
    itself, parses, validates, and has no whitespace outside its strings."""
    model = random_model(bpe_tokenizer.vocab_size)
    grammar = Grammar.json_schema(PERSON, bpe_tokenizer)
    config = settings(bpe_tokenizer, grammar=grammar, do_sample=True, temperature=temperature)
    prompts = ["A person:", "", "{ not json"]
    config = GenerationConfig.of(**{**vars(config), "num_return_sequences": 4, "seed": 3})
    for answer in complete(model, bpe_tokenizer, prompts, config):
        assert answer.finish_reason == "eos", answer.text
        jsonschema_rs.validate(PERSON, json.loads(answer.text))
        assert not re.search(r"\s", STRINGS.sub('""', answer.text)), answer.text


def test_a_bias_cannot_bring_an_invalid_token_and_padding_rows_never_come(bpe_tokenizer):
    """A model with more rows than its tokenizer (padding), a bias of +100 on a padding row
    and on the space token: still only valid JSON."""
    V = bpe_tokenizer.vocab_size
    model = random_model(V + 20, seed=1)
    space = bpe_tokenizer.encode(" ")[0]
    config = settings(
        bpe_tokenizer,
        grammar=Grammar.json_schema(PERSON, bpe_tokenizer),
        logit_bias={V + 5: 100.0, space: 100.0},
        repetition_penalty=1.5,
    )
    (answer,) = complete(model, bpe_tokenizer, ["x"], config)
    assert all(t < V for t in answer.tokens)
    jsonschema_rs.validate(PERSON, json.loads(answer.text))


def test_greedy_takes_the_likeliest_valid_token_and_reports_the_models_logprob(bpe_tokenizer):
    """The first token of (cat|dog|bird)s? is the argmax of the model's logits over the
    tokens that spell a non-empty start of one of its words (worked out here by hand)."""
    model = random_model(bpe_tokenizer.vocab_size, seed=2)
    words = ["cat", "cats", "dog", "dogs", "bird", "birds"]
    pieces = bpe_tokenizer.pieces()
    valid = [t for t, p in enumerate(pieces) if p and any(w.encode().startswith(p) for w in words)]
    config = settings(bpe_tokenizer, grammar=Grammar.regex("(cat|dog|bird)s?", bpe_tokenizer))
    (answer,) = complete(model, bpe_tokenizer, ["Pets:"], config)
    assert answer.text in words
    ids = torch.tensor([[bpe_tokenizer.eot_id, *bpe_tokenizer.encode("Pets:")]])
    with torch.no_grad():
        logits = model(ids)[0, -1]
    first = valid[int(logits[valid].argmax())]
    assert answer.tokens[0] == first
    assert answer.logprobs[0] == pytest.approx(float(logits.log_softmax(-1)[first]), abs=1e-5)


def test_regex_and_lark_outputs_match(bpe_tokenizer):
    model = random_model(bpe_tokenizer.vocab_size, seed=3)
    pattern = r"[0-9]{3}-[a-z]{2,4}"
    lark = 'start: ("yes" | "no") ("!" | "?") " " NAME\nNAME: /[A-Z][a-z]{0,3}/'
    for grammar, check in (
        (Grammar.regex(pattern, bpe_tokenizer), lambda t: re.fullmatch(pattern, t)),
        (
            Grammar.lark(lark, bpe_tokenizer),
            lambda t: re.fullmatch(r"(yes|no)[!?] [A-Z][a-z]{0,3}", t),
        ),
    ):
        config = settings(bpe_tokenizer, grammar=grammar, do_sample=True, temperature=2.0, seed=0)
        config = GenerationConfig.of(**{**vars(config), "num_return_sequences": 6})
        for answer in complete(model, bpe_tokenizer, ["a", "b"], config):
            assert answer.finish_reason == "eos" and check(answer.text), answer.text


def test_an_answer_cut_short_finishes_with_length(bpe_tokenizer):
    model = random_model(bpe_tokenizer.vocab_size)
    schema = {"type": "object", "properties": {"s": {"type": "string", "minLength": 40}}}
    config = settings(bpe_tokenizer, grammar=Grammar.json_schema(schema, bpe_tokenizer))
    config = GenerationConfig.of(**{**vars(config), "max_new_tokens": 6})
    (answer,) = complete(model, bpe_tokenizer, ["x"], config)
    assert answer.finish_reason == "length" and len(answer.tokens) == 6
    assert answer.text.startswith("{")


def test_cached_equals_the_reference_loop_and_a_row_alone_equals_a_batch(bpe_tokenizer):
    model = random_model(bpe_tokenizer.vocab_size, seed=4)
    grammar = Grammar.json_schema(PERSON, bpe_tokenizer)
    base = dict(vars(settings(bpe_tokenizer)), grammar=grammar, do_sample=True, seed=5)
    prompts = ["one", "two two"]
    cached = complete(model, bpe_tokenizer, prompts, GenerationConfig.of(**base))
    reference = complete(
        model, bpe_tokenizer, prompts, GenerationConfig.of(**{**base, "use_cache": False})
    )
    alone = complete(model, bpe_tokenizer, prompts[1:], GenerationConfig.of(**base))
    assert [a.tokens for a in cached] == [a.tokens for a in reference]
    assert cached[1].tokens == alone[0].tokens
    assert cached[0].text != cached[1].text  # the rows do not share a matcher


def test_a_character_vocabulary_writes_json_or_says_it_cannot():
    chars = CharTokenizer('{}[]":,-0123456789 abcdefghijklmnopqrstuvwxyz')
    assert b"".join(chars.pieces()[i] for i in chars.encode('{"a": 1}')) == b'{"a": 1}'
    model = random_model(chars.vocab_size, seed=6)
    config = settings(chars, grammar=Grammar.json_schema(PERSON, chars), do_sample=True, seed=1)
    (answer,) = complete(model, chars, ["abc"], config)
    jsonschema_rs.validate(PERSON, json.loads(answer.text))
    digits = CharTokenizer("0123456789")  # no "{": llguidance masks nothing or everything
    for schema in ({"type": "object"}, PERSON):
        config = settings(digits, grammar=Grammar.json_schema(schema, digits))
        with pytest.raises(GenerationError, match="no token of this|can the vocabulary spell"):
            complete(random_model(digits.vocab_size), digits, ["1"], config)


def test_pieces_spell_what_decode_writes(bpe_tokenizer):
    text = 'Ünïcode — {"key": [1, 2]}\n\ttabs and spaces  '
    ids = bpe_tokenizer.encode(text)
    assert b"".join(bpe_tokenizer.pieces()[i] for i in ids).decode() == text
    assert bpe_tokenizer.pieces()[bpe_tokenizer.eot_id] == b"<|endoftext|>"


def test_mistakes_are_one_line_errors(bpe_tokenizer, monkeypatch):
    for make, source, word in (
        (Grammar.json_schema, {"type": "objectx"}, "invalid json schema"),
        (Grammar.regex, "[0-9", "invalid regex"),
        (Grammar.lark, "start: undefined_rule", "invalid lark"),
    ):
        with pytest.raises(GenerationError, match=word) as caught:
            make(source, bpe_tokenizer)
        assert "\n" not in str(caught.value)
    grammar = Grammar.regex("a+", bpe_tokenizer)
    with pytest.raises(GenerationError, match="use num_beams=1"):
        GenerationConfig(num_beams=2, grammar=grammar)
    small = random_model(bpe_tokenizer.vocab_size - 1)  # fewer rows than the tokenizer
    for use_cache in (True, False):  # the cached loop and the reference loop alike
        config = settings(bpe_tokenizer, grammar=grammar, use_cache=use_cache)
        with pytest.raises(GenerationError, match="the model has"):
            complete(small, bpe_tokenizer, ["a"], config)
    monkeypatch.setitem(sys.modules, "llguidance", None)
    with pytest.raises(GenerationError, match=r"pip install 'tlm\[structured\]'"):
        Grammar.regex("a+", bpe_tokenizer)


def test_tlm_generate_json_schema_and_regex(tmp_path, bpe_tokenizer, capsys):
    run = save_run(tmp_path / "run", random_model(bpe_tokenizer.vocab_size), bpe_tokenizer)
    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(PERSON))
    args = ["generate", str(run), "--prompt", "P:", "--max-new-tokens", "200", "--json"]
    assert main([*args, "--json-schema", str(schema), "--do-sample", "-n", "2"]) == 0
    for answer in json.loads(capsys.readouterr().out)["completions"]:
        jsonschema_rs.validate(PERSON, json.loads(answer["text"]))
    assert main([*args, "--regex", "[a-c]{2}[0-9]"]) == 0
    (answer,) = json.loads(capsys.readouterr().out)["completions"]
    assert re.fullmatch("[a-c]{2}[0-9]", answer["text"])
    assert main([*args, "--json-schema", str(tmp_path / "missing.json")]) != 0
    schema.write_text("{not json")
    assert main([*args, "--json-schema", str(schema)]) != 0
    assert "not JSON" in capsys.readouterr().err


def stream(url, body):
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Authorization": f"Bearer {KEY}"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return [json.loads(line[6:]) for line in response if line.startswith(b"data: {")]


@pytest.mark.slow  # a server process
def test_tlm_serve_response_format(server, served_run):
    """json_schema and json_object through both endpoints, whole and streamed: valid JSON
    from the model the server tests train (which never saw JSON); greedy equals the
    library's; an answer cut short says length."""
    person = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    body = {"messages": [{"role": "user", "content": "for?"}], "max_tokens": 200}
    status, answer, _ = post(
        server + "/v1/chat/completions",
        {**body, "response_format": person, "n": 3, "temperature": 1.5, "seed": 1},
    )
    assert status == 200, answer
    for choice in answer["choices"]:
        assert choice["finish_reason"] == "stop"
        jsonschema_rs.validate(PERSON, json.loads(choice["message"]["content"]))
    chunks = stream(
        server + "/v1/chat/completions", {**body, "response_format": person, "stream": True}
    )
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    jsonschema_rs.validate(PERSON, json.loads(text))
    greedy = {"prompt": "The", "max_tokens": 120, "temperature": 0}
    status, answer, _ = post(server + "/v1/completions", {**greedy, "response_format": person})
    grammar = Grammar.json_schema(PERSON, load_tokenizer(served_run))
    assert answer["choices"][0]["text"] == local(served_run, "The", 120, grammar=grammar).text
    jsonschema_rs.validate(PERSON, json.loads(answer["choices"][0]["text"]))
    # sampled: greedy writes a string that never ends; seed 3's sample closes its object
    # within 120 tokens (seeds 0 and 1 write on to the limit)
    sampled = {"prompt": "The", "max_tokens": 120, "seed": 3}
    status, answer, _ = post(
        server + "/v1/completions", {**sampled, "response_format": {"type": "json_object"}}
    )
    assert answer["choices"][0]["finish_reason"] == "stop"
    assert isinstance(json.loads(answer["choices"][0]["text"]), dict)
    status, answer, _ = post(
        server + "/v1/completions", {**greedy, "max_tokens": 3, "response_format": person}
    )
    assert answer["choices"][0]["finish_reason"] == "length"
    assert '{"name":"'.startswith(answer["choices"][0]["text"]) and answer["choices"][0]["text"]


@pytest.mark.slow  # a server process
def test_the_openai_client_gets_structured_outputs_and_the_model(server):
    """The official client's own shapes: response_format as it sends it, models.retrieve."""
    import openai

    client = openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0)
    (served,) = client.models.list().data
    assert client.models.retrieve(served.id).id == served.id
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    answer = client.chat.completions.create(
        model=served.id,
        messages=[{"role": "user", "content": "for?"}],
        max_tokens=200,
        seed=4,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON, "strict": True},
        },
    )
    assert answer.choices[0].finish_reason == "stop"
    jsonschema_rs.validate(PERSON, json.loads(answer.choices[0].message.content))
    with pytest.raises(openai.BadRequestError, match="invalid json schema") as refused:
        client.chat.completions.create(
            model=served.id,
            messages=[{"role": "user", "content": "for?"}],
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "objectx"}},
            },
        )
    assert refused.value.param == "response_format"


@pytest.mark.parametrize("draft", [{"prompt_lookup": 2}, {"draft": "int8"}])
def test_a_grammar_with_a_draft_writes_what_it_writes_without(bpe_tokenizer, draft, monkeypatch):
    """Speculative decoding under a grammar: every token the row keeps is its chooser's,
    masked by the matcher as in plain decoding, so the text is the same, greedy or sampled;
    a drafted token the grammar forbids is never kept."""
    from tlm.generate.slots import Slots

    model = random_model(bpe_tokenizer.vocab_size)
    grammar = Grammar.regex("((cat|dog|bird)s? ){2,12}(fish)", bpe_tokenizer)
    checks, speculate = [], Slots._speculate
    monkeypatch.setattr(Slots, "_speculate", lambda *a: checks.append(1) or speculate(*a))
    for more in ({}, {"do_sample": True, "temperature": 0.8, "seed": 5}):
        plain = settings(bpe_tokenizer, grammar=grammar, **more)
        fast = GenerationConfig.of(**{**vars(plain), **draft})
        for prompt in ["cats dogs cats dogs", "birds"]:  # alone: a row drafts at batch 1
            (expected,) = complete(model, bpe_tokenizer, [prompt], plain)
            (got,) = complete(model, bpe_tokenizer, [prompt], fast)
            assert got.text == expected.text
            assert re.fullmatch("((cat|dog|bird)s? ){2,12}(fish)", got.text)
    assert checks  # drafts were checked
