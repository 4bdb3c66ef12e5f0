"""`tlm inspect`: the pictures, the page in a real headless Chromium, and bad input."""

import json
import re
from pathlib import Path

import pytest
import torch

from conftest import console_errors, varied_char_run
from tlm import load_model, load_tokenizer
from tlm.cli import main
from tlm.generate.sampling import process_logits
from tlm.interpret import logit_lens, run_with_cache

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "out" / "test-artifacts"  # screenshots of the page, kept after the run
PROMPT, CORRUPTED = "The for statement", "The far statement"  # one character changed


@pytest.fixture(scope="module")
def run(docs_chars, tmp_path_factory):
    """A run directory of a small random model with the python-docs characters."""
    folder = tmp_path_factory.mktemp("runs") / "tiny"
    return varied_char_run(docs_chars, folder, n_layers=3, context_length=48)


@pytest.fixture(scope="module")
def report(run, tmp_path_factory):
    out = tmp_path_factory.mktemp("inspect")
    args = ["inspect", str(run), "--prompt", PROMPT, "--corrupted", CORRUPTED]
    assert main([*args, "--target", "n", "--layer", "1", "--head", "2", "--out", str(out)]) == 0
    return out


def page_data(report):
    html = (report / "index.html").read_text()
    inline = re.search(r'<script id="data" type="application/json">(.*?)</script>', html, re.S)
    return json.loads(inline.group(1))


@pytest.mark.slow
def test_inspect_writes_the_pictures_and_a_self_contained_page(report, run):
    names = sorted(p.name for p in report.iterdir())
    assert names == [
        "attention-L1H2.png",
        "attention.png",
        "index.html",
        "logit-lens.png",
        "patching-heads.png",
        "patching-positions.png",
        "residual-norms.png",
    ]
    assert all((report / n).read_bytes()[:4] == b"\x89PNG" for n in names if n.endswith(".png"))
    html = (report / "index.html").read_text()
    assert "http://" not in html and "https://" not in html and "src=" not in html  # no network
    data = page_data(report)
    tokenizer = load_tokenizer(run)
    ids = [tokenizer.eot_id, *tokenizer.encode(PROMPT)]
    assert data["tokens"] == [tokenizer.decode([i]) for i in ids]
    patterns = torch.tensor(data["patterns"])
    assert patterns.shape == (3, 4, len(ids), len(ids))
    assert torch.allclose(patterns.sum(-1), torch.ones(3, 4, len(ids)), atol=1e-3)
    _, top = logit_lens(load_model(run), torch.tensor([ids])).top(5)
    for depth in range(4):  # the page's lens is the library's
        words = [cell[0][0] for cell in data["lens"]["top"][depth]]
        assert words == [tokenizer.decode([int(i)]) for i in top[depth, :, 0]]
    recovery = data["patching"]["positions"]["recovery"][0]  # entering block 0, at position
    assert recovery[6] == pytest.approx(1.0, abs=1e-3)  # 6 ("o" / "a") the stream is the token
    assert recovery[:6] == [0.0] * 6
    assert data["attribution"]["target"] == "n"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--prompt", ""], "the clean prompt tokenizes to nothing"),
        (["--prompt", "x" * 60], "the clean prompt has 61 tokens; the model reads at most 48"),
        (["--prompt", "ab", "--corrupted", "abc"], "the corrupted prompt has 4 tokens and"),
        (["--prompt", "ab", "--layer", "3"], "layer 3 is out of range: the model has layers 0..2"),
        (["--prompt", "ab", "--head", "9"], "head 9 is out of range: the model has heads 0..3"),
        (["--prompt", "ab", "--target", "xy"], "--target 'xy' is 2 tokens"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(run, tmp_path, capsys, args, message):
    assert main(["inspect", str(run), *args, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tlm: error:") and message in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_the_page_in_a_real_browser(browser, report, run):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    data = page_data(report)
    T = len(data["tokens"])
    browser.get((report / "index.html").as_uri())
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    browser.save_screenshot(str(ARTIFACTS / "inspect-page.png"))
    rows = browser.find_elements(By.CSS_SELECTOR, "#grid tr[data-query]")
    assert len(rows) == T and all(
        len(r.find_elements(By.CSS_SELECTOR, "td.cell")) == T for r in rows
    )

    def grid_colours():
        cells = browser.find_elements(By.CSS_SELECTOR, "#grid td.cell")
        return [c.value_of_css_property("background-color") for c in cells]

    first = grid_colours()
    assert first[T] != first[T + 1] or first[2 * T] != first[2 * T + 1]  # α varies along a row
    assert first[1] == "rgba(255, 255, 255, 1)"  # above the diagonal: α = 0 (causal)
    Select(browser.find_element(By.ID, "layer")).select_by_value("2")
    Select(browser.find_element(By.ID, "head")).select_by_value("3")
    assert grid_colours() != first  # another layer and head draw another grid

    for position in (2, T - 3):  # hovering a token shows the lens at that position
        ActionChains(browser).move_to_element(
            browser.find_element(By.ID, f"tok-{position}")
        ).perform()
        title = browser.find_element(By.ID, "lens-position").text
        assert title.startswith(f"position {position}")
        cells = browser.find_elements(By.CSS_SELECTOR, "#lens tr")[-1].find_elements(
            By.TAG_NAME, "td"
        )
        word, prob = data["lens"]["top"][-1][position][0]
        assert cells[0].text == f"{json.dumps(word, ensure_ascii=False)[1:-1]} {prob:.3f}"
        selected = browser.find_element(By.CSS_SELECTOR, "#grid tr.selected")
        assert selected.get_attribute("data-query") == str(position)
    browser.save_screenshot(str(ARTIFACTS / "inspect-page-hover.png"))
    heat = browser.find_elements(By.CSS_SELECTOR, "#patching tr")
    assert len(heat) == 1 + 3 and browser.find_element(By.ID, "patching-section").is_displayed()
    assert console_errors(browser) == []


def test_a_javascript_error_would_fail_the_page_test(browser, report, tmp_path):
    """The console check can fail: a page whose script throws is caught."""
    broken = tmp_path / "index.html"
    broken.write_text((report / "index.html").read_text().replace("drawGrid();\n", "drawGird();\n"))
    browser.get(broken.as_uri())
    assert any("drawGird" in message for message in console_errors(browser))


@pytest.mark.slow
def test_inspect_reads_a_hugging_face_gpt2_directory(gpt2_dir, tmp_path):
    out = tmp_path / "out"
    args = ["inspect", str(gpt2_dir), "--prompt", "The for statement", "--out", str(out)]
    assert main([*args, "--corrupted", "The if statement"]) == 0
    data = page_data(out)
    tokenizer = load_tokenizer(gpt2_dir)
    assert data["tokens"][1:] == [
        tokenizer.decode([i]) for i in tokenizer.encode("The for statement")
    ]
    assert len(data["patterns"]) == 2 and data["patching"]["heads"]["columns"] == [
        "H0",
        "H1",
        "H2",
        "H3",
    ]


def test_the_pages_lessons_are_the_models(browser, report, run):
    """The static page's distribution after the prompt, under the sliders, is the model's
    filtered by `process_logits`; its attention steps are the hook points' values."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    data = page_data(report)
    ids, T = data["ids"], len(data["tokens"])
    model = load_model(run)
    names = [f"blocks.2.attn.{n}" for n in ("v", "scores", "pattern")]
    logits, cache = run_with_cache(model, torch.tensor([ids]), names)
    browser.get((report / "index.html").as_uri())
    tokens = browser.find_elements(By.CSS_SELECTOR, ".token")
    assert [int(t.get_attribute("data-id")) for t in tokens] == ids

    def rows():
        return browser.execute_script(
            "return [...document.querySelectorAll('#dist tr[data-token]')]"
            ".map(r => [Number(r.dataset.id), Number(r.dataset.p)])"
        )

    for temperature, k, p in [(1, 0, 1), (0.5, 0, 1), (1.5, 5, 0.8)]:
        for name, value in (("temperature", temperature), ("top-k", k), ("top-p", p)):
            browser.execute_script(
                "const s = document.getElementById(arguments[0]); s.value = arguments[1];"
                "s.dispatchEvent(new Event('input'));",
                name,
                str(value),
            )
        want = process_logits(logits[0, -1], temperature, k or None, p if p < 1 else None)
        want = want.softmax(dim=-1)
        got = rows()
        assert len(got) == 20 and all(abs(q - float(want[t])) < 1e-4 for t, q in got)

    Select(browser.find_element(By.ID, "layer")).select_by_value("2")
    Select(browser.find_element(By.ID, "head")).select_by_value("1")
    scores, pattern = cache[names[1]][0, 1], cache[names[2]][0, 1]
    for panel, want in (("masked", scores), ("pattern", pattern)):
        cells = browser.execute_script(
            "return [...document.querySelectorAll(`#${arguments[0]} td[data-row]`)]"
            ".map(c => [Number(c.dataset.row), Number(c.dataset.col), c.dataset.value])",
            panel,
        )
        got = torch.full((T, T), float("nan"))
        for i, j, value in cells:
            got[i, j] = float(value)
        assert torch.equal(got.isinf(), want.isinf())
        assert torch.allclose(got[~want.isinf()], want[~want.isinf()], atol=1e-5, rtol=0)
    contrib = browser.execute_script(
        "return [...document.querySelectorAll('#contrib td[data-row]')]"
        ".map(c => Number(c.dataset.value))"
    )
    norms = cache[names[0]][0, 1].norm(dim=-1)
    assert torch.allclose(torch.tensor(contrib), pattern[T - 1] * norms, atol=1e-5, rtol=0)
    browser.save_screenshot(str(ARTIFACTS / "inspect-page-lessons.png"))
    assert console_errors(browser) == []


def test_an_encoders_page_shows_attention_both_ways(browser, words_mlm, tmp_path, capsys):
    """An encoder read as [CLS] prompt [SEP]: every query reads keys on both sides (the page
    draws α above the diagonal), and the lens at [MASK] ends at what fill-mask says."""
    from selenium.webdriver.common.by import By

    out = tmp_path / "encoder"
    prompt = ["--prompt", "string pyt[MASK]on module"]
    assert main(["inspect", str(words_mlm), *prompt, "--out", str(out)]) == 0
    data = page_data(out)
    tokens, patterns = data["tokens"], torch.tensor(data["patterns"])  # [L,H,T,T]
    assert tokens[0] == "[CLS]" and tokens[-1] == "[SEP]" and "bidirectional" in data["model"]
    assert torch.allclose(patterns.sum(-1), torch.ones(patterns.shape[:-1]), atol=1e-3)
    assert (patterns[:, :, 0, 1:].sum(-1) > 0.01).all()  # [CLS] reads the keys after it
    assert data["lens"]["top"][-1][tokens.index("[MASK]")][0][0] == "h"  # p-y-t-?-o-n
    assert "next" not in data and data["attribution"] is None
    browser.get((out / "index.html").as_uri())
    cells = browser.find_elements(By.CSS_SELECTOR, "#grid td.cell")
    assert cells[1].value_of_css_property("background-color") != "rgba(255, 255, 255, 1)"
    assert console_errors(browser) == []
    assert main(["inspect", str(words_mlm), *prompt, "--corrupted", "x", "--out", str(out)]) == 2
    assert "follow a language model's next token" in capsys.readouterr().err
