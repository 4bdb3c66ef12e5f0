"""The built-in arithmetic task (issue 63, part 4): seeded problems, held out by problem, as
chat data, preference pairs and prompts, all checked by the `number` verifier."""

from tlm.cli import main
from tlm.data import PreferenceData, PromptData
from tlm.data import arithmetic as a
from tlm.train.rewards import number


def test_problems_are_seeded_of_two_to_four_digits_in_all_with_every_operation():
    problems = a.problems()
    assert problems == a.problems() and len(set(problems)) == len(problems) == a.PROBLEMS
    assert {op for _, op, _ in problems} == {"+", "-", "*"}
    digits = [len(str(x)) + len(str(y)) for x, _, y in problems]
    assert set(digits) == {2, 3, 4} and min(digits.count(n) for n in (2, 3, 4)) >= 250
    splits = {(len(str(x)), len(str(y))) for x, _, y in problems}
    assert splits == {(1, 1), (1, 2), (2, 1), (1, 3), (2, 2), (3, 1)}
    assert all(len(str(n)) == 1 or str(n)[0] != "0" for x, _, y in problems for n in (x, y))
    assert a.problems(seed=1) != problems


def test_the_held_out_problems_are_never_trained_on_in_any_task():
    for make in (a.arithmetic_chat, a.arithmetic_pairs, a.arithmetic_prompts):
        train, val, _ = make()
        assert len(val) > 0.07 * a.PROBLEMS and len(train) + len(val) == a.PROBLEMS
    train, val, _ = a.arithmetic_prompts()
    asked = lambda part: {record["prompt"] for _, record in part}  # noqa: E731
    assert not asked(train) & asked(val)
    train, val = a.split(lambda problem: problem)  # a problem: both numbers and the operation
    assert not {p for _, p in train} & {p for _, p in val}


def test_the_verifier_passes_the_worked_answer_and_fails_the_mistake():
    for problem in a.problems()[:500]:
        right = a.result(problem)
        assert number(a.worked(problem), right) == 1.0
        assert a.mistake(problem) != right
        assert number(a.worked(problem, a.mistake(problem)), right) == 0.0
    x, op, y = a.problems()[0]
    assert str(x) in a.question((x, op, y)) and str(y) in a.question((x, op, y))


def test_prepare_makes_each_task_of_it(tmp_path, capsys):
    for task in ("chat", "preference", "prompts"):
        out = tmp_path / task
        assert main(["prepare", "--task", task, "arithmetic", "--tokenizer", "char", "--out",
                     str(out)]) == 0  # fmt: skip
    prompts = PromptData(tmp_path / "prompts")
    _, val, _ = a.arithmetic_prompts()
    assert prompts.answers("val") == [record["answer"] for _, record in val]
    assert PreferenceData(tmp_path / "preference").pairs("val") == len(val)
    assert main(["prepare", "--task", "prompts", "arithmetic", "x.jsonl", "--out",
                 str(tmp_path / "both")]) == 2  # fmt: skip
    assert "whole corpus with its own split" in capsys.readouterr().err
