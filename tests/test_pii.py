"""Personal data in corpora (J&M §10.10): tlm prepare --pii report|mask."""

import json

import numpy as np
import pytest

from tlm import load_tokenizer
from tlm.cli import main
from tlm.data.corpus import Piece
from tlm.data.pii import Scanner, find, luhn, scanned

POSITIVES = {
    "email": ["ada@example.com", "first.last+tag@mail.example.co.uk", "x_y%z@sub-domain.org"],
    "phone": ["(415) 555-2671", "415-555-2671", "+44 20 7946 0958", "+1 212 555 0100"],
    "ip": ["192.168.1.20", "8.8.8.8", "2001:db8:85a3::8a2e:370:7334", "fe80:0:0:0:1:2:3:4"],
    "card": ["4111 1111 1111 1111", "5500-0000-0000-0004", "378282246310005", "6011111111111117"],
}
NEGATIVES = [
    "write to ada at example dot com",
    "an @decorator and user@localhost",
    "x[1::2] and a::b and std::vector",
    "999.1.1.1 and 10.0.0",
    "4111 1111 1111 1112 fails its check digit",
    "2147483647 is the largest int32; 3.14159; 2026-11-25",
    "1234 5678",
]


@pytest.mark.parametrize("kind", sorted(POSITIVES))
def test_each_kind_is_found(kind):
    for item in POSITIVES[kind]:
        text = f"Contact: {item}, thanks."
        found = find(text)
        assert [(f.kind, text[f.start : f.end]) for f in found] == [(kind, item)], item


@pytest.mark.parametrize("text", NEGATIVES)
def test_what_is_not_personal_data_is_not_found(text):
    assert find(text) == []


def test_luhn():
    assert luhn("79927398713") and not luhn("79927398710")


def test_mask_replaces_each_item_and_counts_it():
    scanner = Scanner("mask")
    text = "Mail ada@example.com or call (415) 555-2671 from 10.1.2.3 with 4111-1111-1111-1111."
    assert scanner(text) == "Mail <EMAIL> or call <PHONE> from <IP> with <CARD>."
    assert scanner.counts == {"email": 1, "phone": 1, "ip": 1, "card": 1}
    report = Scanner("report")
    assert report(text) == text and report.counts == scanner.counts


def test_an_item_split_between_pieces_is_still_found():
    pieces = [Piece("line one\nwrite to ada@exa", False), Piece("mple.com today\nend", False)]
    scanner = Scanner("mask")
    out = list(scanned(iter(pieces + [Piece("", True)]), scanner))
    assert "".join(p.text for p in out) == "line one\nwrite to <EMAIL> today\nend"
    assert scanner.counts["email"] == 1 and out[-1].ends_document


def test_prepare_masks_every_item_out_of_the_token_files(tmp_path):
    lines = [f"Record {i}: {item} is on file." for i, items in enumerate(POSITIVES.values())
             for item in items]  # fmt: skip
    corpus = tmp_path / "people.txt"
    corpus.write_text("\n".join(lines * 5 + NEGATIVES) + "\n")
    out = tmp_path / "data"
    assert main(["prepare", str(corpus), "--out", str(out), "--tokenizer", "char", "--line-docs",
                 "--val-fraction", "0.2", "--pii", "mask", "--quiet"]) == 0  # fmt: skip
    meta = json.loads((out / "meta.json").read_text())
    counts = {"email": 15, "phone": 20, "ip": 20, "card": 20}
    assert meta["pii"] == {"mode": "mask", "region": "US", "counts": counts}
    tokenizer = load_tokenizer(out)
    text = "".join(
        tokenizer.decode(np.fromfile(out / f"{split}.bin", dtype=np.uint16).tolist())
        for split in ("train", "val")
    )
    assert find(text) == [] and text.count("<EMAIL>") == 15
    for items in POSITIVES.values():
        assert not any(item in text for item in items)
    assert "2147483647" in text  # what is not personal data is left as it was


def test_report_counts_and_leaves_the_text(tmp_path, capsys):
    corpus = tmp_path / "people.txt"
    corpus.write_text("ada@example.com\nnothing here\ncall +44 20 7946 0958\n")
    out = tmp_path / "data"
    main(["prepare", str(corpus), "--out", str(out), "--tokenizer", "char", "--line-docs",
          "--pii", "report", "--quiet"])  # fmt: skip
    assert "1 email, 1 phone, 0 ip, 0 card (left in)" in capsys.readouterr().out
    assert json.loads((out / "meta.json").read_text())["pii"]["counts"]["phone"] == 1


def test_a_region_that_does_not_exist_is_refused(tmp_path, capsys):
    corpus = tmp_path / "a.txt"
    corpus.write_text("text\n")
    code = main(["prepare", str(corpus), "--out", str(tmp_path / "d"), "--tokenizer", "char",
                 "--pii", "report", "--pii-region", "XX", "--quiet"])  # fmt: skip
    assert code == 2 and "--pii-region" in capsys.readouterr().err


def test_overlapping_findings_keep_the_one_that_starts_first():
    scanner = Scanner("mask")
    assert scanner("mail root@10.1.2.3.example.com now") == "mail <EMAIL> now"
    assert scanner.counts == {"email": 1, "phone": 0, "ip": 0, "card": 0}


def test_the_model_card_names_the_counts():
    from tlm.train.privacy import privacy_section

    meta = {"pii": {"mode": "mask", "region": "US", "counts": {"email": 2, "phone": 0, "ip": 3}}}
    text = privacy_section(meta, None)
    assert "email 2, phone 0, ip 3, card 0 (replaced by placeholders)" in text
    assert "not scanned" in privacy_section({}, None)
