"""Personal data in a corpus (J&M §10.10): e-mail addresses, phone numbers, IP addresses
and payment card numbers, found before tokenization and counted (`report`) or replaced by
a placeholder (`mask`).

- **Phone numbers** are libphonenumber's (the `phonenumbers` package): its matcher finds
  numbers written in any of the usual ways and keeps those valid for their region
  (numbers without a country code are read as `region`'s, "US" by default). A run of
  digits with no space, hyphen, bracket or `+` in it is not taken for one: in code and
  prose, 2147483647 is an integer far more often than a phone number.
- **E-mail addresses**: a local part, `@`, a domain of dot-separated labels ending in a
  top-level domain of two or more letters.
- **IP addresses**: IPv4 dotted quads and IPv6 addresses of three or more groups, each
  candidate checked by the standard library's `ipaddress` (so 999.1.1.1 is not one, and
  a slice such as `x[1::2]` is not taken for an IPv6 address).
- **Card numbers**: 13 to 19 digits, in groups separated by single spaces or hyphens,
  starting as the card networks' numbers do (2-6), whose Luhn check digit holds.

Where two findings overlap, the one that starts first (then the longer) is kept. A finding
never spans a line: `scanned` holds back each piece's last line until it knows the line
has ended, so text read in chunks is scanned as if it were whole.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

import phonenumbers

from tlm.data.corpus import CorpusError, Piece

KINDS = ("email", "phone", "ip", "card")
MODES = ("report", "mask")
PLACEHOLDER = {kind: f"<{kind.upper()}>" for kind in KINDS}

EMAIL = re.compile(r"(?<![\w.%+-])[\w.%+-]+@(?:[A-Za-z0-9-]+\.)+[A-Za-z]{2,}(?![\w-])")
IPV4 = re.compile(r"(?<![\w.])(?:\d{1,3}\.){3}\d{1,3}(?![\w.]*\d)")
IPV6 = re.compile(r"(?<![\w:])[0-9A-Fa-f]{0,4}(?::[0-9A-Fa-f]{0,4}){2,7}(?![\w:])")
WRITTEN = re.compile(r"[\s()+-]")  # a phone number as people write one, not a bare integer
CARD = re.compile(r"(?<![\d-])[2-6]\d{3}(?:[ -]?\d{1,4}){2,4}(?![\d-])")


@dataclass
class Found:
    kind: str
    start: int
    end: int


def luhn(digits: str) -> bool:
    """The Luhn checksum: every second digit from the right doubled (9 subtracted above 9),
    the sum a multiple of 10."""
    total = 0
    for i, char in enumerate(reversed(digits)):
        d = int(char) * (2 if i % 2 else 1)
        total += d - 9 if d > 9 else d
    return total % 10 == 0


def _ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def find(text: str, region: str = "US") -> list[Found]:
    """Every finding in `text`, in order, none overlapping."""
    found = [Found("email", m.start(), m.end()) for m in EMAIL.finditer(text)]
    found += [Found("ip", m.start(), m.end()) for m in IPV4.finditer(text) if _ip(m.group())]
    found += [
        Found("ip", m.start(), m.end())
        for m in IPV6.finditer(text)
        if len(re.findall(r"[0-9A-Fa-f]+", m.group())) >= 3 and _ip(m.group())
    ]
    for m in CARD.finditer(text):
        digits = re.sub(r"[ -]", "", m.group())
        if 13 <= len(digits) <= 19 and luhn(digits):
            found.append(Found("card", m.start(), m.end()))
    matcher = phonenumbers.PhoneNumberMatcher(text, region, leniency=phonenumbers.Leniency.VALID)
    found += [Found("phone", m.start, m.end) for m in matcher if WRITTEN.search(m.raw_string)]
    found.sort(key=lambda f: (f.start, -f.end))
    kept: list[Found] = []
    for f in found:
        if not kept or f.start >= kept[-1].end:
            kept.append(f)
    return kept


@dataclass
class Scanner:
    """Counts findings per kind and, in mode "mask", replaces each by its placeholder."""

    mode: str
    region: str = "US"
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise CorpusError(f"--pii takes {' or '.join(MODES)}, not {self.mode!r}")
        if phonenumbers.country_code_for_region(self.region) == 0:
            raise CorpusError(f"--pii-region takes a region code such as US or GB: {self.region!r}")

    def __call__(self, text: str) -> str:
        found = find(text, self.region)
        for f in found:
            self.counts[f.kind] += 1
        if self.mode == "report" or not found:
            return text
        parts, at = [], 0
        for f in found:
            parts += [text[at : f.start], PLACEHOLDER[f.kind]]
            at = f.end
        return "".join(parts) + text[at:]

    def describe(self) -> dict:
        return {"mode": self.mode, "region": self.region, "counts": dict(self.counts)}


def scanned(pieces: Iterator[Piece], scanner: Scanner) -> Iterator[Piece]:
    """The pieces through `scanner`, each document's text cut only at line ends (a piece
    that does not end its document gives up its last line to the next piece)."""
    held = ""
    for piece in pieces:
        text = held + piece.text
        if piece.ends_document:
            held = ""
            yield Piece(scanner(text), True)
            continue
        cut = text.rfind("\n") + 1
        held = text[cut:]
        if cut:
            yield Piece(scanner(text[:cut]), False)
    if held:
        yield Piece(scanner(held), False)
