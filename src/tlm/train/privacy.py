"""The model card's section on memorization and privacy (J&M §10.10): what `tlm prepare`
found or planted in the data (personal data counts, canaries: never the secrets), and the
figures of `tlm audit` once it has run on the model. Training writes the section without
an audit (the model has just changed); `tlm audit` rewrites it with its figures."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tlm.io import write_text_atomic

HEADING = "## Memorization and privacy (§10.10)"
PII_KINDS = ("email", "phone", "ip", "card")


def privacy_section(
    data_meta: dict[str, Any], epochs: float | None, audit: dict[str, Any] | None = None
) -> str:
    """The section's text, from the data's meta.json, the passes over the training split
    the run made, and an audit report (`tlm audit --json`'s object) if there is one."""
    lines = [HEADING, ""]
    pii = data_meta.get("pii")
    if pii is None:
        lines.append("Personal data: the corpus was not scanned (`tlm prepare --pii report`).")
    else:
        counts = ", ".join(f"{kind} {pii['counts'].get(kind, 0):,}" for kind in PII_KINDS)
        done = "replaced by placeholders" if pii["mode"] == "mask" else "left in the text"
        command = f"`tlm prepare --pii {pii['mode']}`"
        lines.append(f"Personal data found by {command}: {counts} ({done}).")
    canaries = data_meta.get("canaries")
    if canaries:
        lines.append("")
        repeats = ", ".join(str(c["repeats"]) for c in canaries)
        seen = "" if epochs is None else f" ({epochs:.1f} passes over the training split)"
        lines.append(
            f"Canaries: {len(canaries)} random secrets planted {repeats} times{seen}; the "
            "secrets are in the data's meta.json, not here."
        )
    lines.append("")
    if audit is None:
        lines.append("Not audited yet: `tlm audit RUN --data DATA` measures what it gives back.")
        return "\n".join(lines) + "\n"
    lines += _audit_lines(audit, epochs)
    return "\n".join(lines) + "\n"


def _audit_lines(audit: dict[str, Any], epochs: float | None) -> list[str]:
    lines = [
        "`tlm audit`: windows of the training and validation splits, their prefix decoded",
        "greedily; extracted = the true suffix given back exactly (95% Wilson interval).",
        "",
        "| split | windows | extracted | rate (95% interval) | tokens right |",
        "|---|---|---|---|---|",
    ]
    for split, r in audit["extraction"].items():
        lines.append(
            f"| {split} | {r['windows']:,} | {r['exact']:,} | {r['rate']:.2%} "
            f"({r['low']:.2%}-{r['high']:.2%}) | {r['token_match']:.2%} |"
        )
    lines += ["", "| occurrences in the training split | windows | extracted |", "|---|---|---|"]
    for row in audit["duplication"]:
        lines.append(f"| {row['bucket']} | {row['windows']:,} | {row['rate']:.2%} |")
    if audit["canaries"]:
        lines += ["", "| times planted | seen in training | exposure (bits) | given back |"]
        lines.append("|---|---|---|---|")
        for c in audit["canaries"]:
            seen = "n/a" if epochs is None else f"~{c['repeats'] * epochs:.0f} times"
            lines.append(
                f"| {c['repeats']} | {seen} | {c['exposure']:.1f} of "
                f"{c['max_exposure']:.1f} | {'yes' if c['extracted'] else 'no'} |"
            )
    return lines


def rewrite_section(card: Path, section: str) -> None:
    """Replace the card's section (or add it before "## Limits", or at the end)."""
    text = card.read_text()
    if HEADING in text:
        head, rest = text.split(HEADING, 1)
        after = rest.find("\n## ")
        text = head + section + (rest[after + 1 :] if after >= 0 else "")
    elif "\n## Limits" in text:
        head, rest = text.split("\n## Limits", 1)
        text = head + "\n" + section + "\n## Limits" + rest
    else:
        text = text.rstrip("\n") + "\n\n" + section
    write_text_atomic(card, text)
