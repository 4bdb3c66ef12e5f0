"""`inspect_prompt`: everything `tlm inspect` shows about one prompt, as JSON-ready data,
and `write_report`: the pictures and one self-contained page (`index.html`, data inline).

A bidirectional encoder (J&M ch. 11) is read as it reads text, `[CLS] prompt [SEP]` (a
[MASK] in the prompt is its token): its patterns are all-to-all, every row of α spread
over keys on both sides, and the lens reads each depth through its head (the MLM head's
tokens, or a fine-tuned head's labels). The panels that follow one next token (the
distribution, the steps of a causal head, attribution and patching of a logit) are a
language model's."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from tlm.device import placement
from tlm.interpret.attention import attention_patterns, attention_steps
from tlm.interpret.attribution import direct_logit_attribution
from tlm.interpret.hooks import HookError
from tlm.interpret.lens import logit_lens, residual_stream
from tlm.interpret.patching import patching_sweep
from tlm.interpret.plots import (
    plot_attention,
    plot_attention_grid,
    plot_logit_lens,
    plot_patching,
    plot_residual_norms,
)
from tlm.io import write_text_atomic
from tlm.model import Encoder, TransformerLM
from tlm.tokenizer import Tokenizer, document_ids, within


def encode_prompt(
    model: TransformerLM | Encoder, tokenizer: Tokenizer, prompt: str | list[int], what: str
) -> list[int]:
    """<|endoftext|> then the prompt's tokens (an encoder's: [CLS] prompt [SEP]; token ids:
    as they are); refused if empty or longer than the context."""
    name, limit = f"the {what} prompt", model.config.context_length
    if isinstance(prompt, str) and isinstance(model, Encoder):
        cls, sep = tokenizer.special_id("[CLS]"), tokenizer.special_id("[SEP]")
        ids = within([cls, *tokenizer.encode(prompt), sep], limit, name)
        if len(ids) == 2:
            raise HookError(f"the {what} prompt tokenizes to nothing; give some text")
    elif isinstance(prompt, str):
        ids = document_ids(tokenizer, prompt, limit, name)
    else:
        ids = within(list(prompt), limit, name)
    if len(ids) == 1:
        raise HookError(f"the {what} prompt tokenizes to nothing; give some text")
    return ids


def one_token(tokenizer: Tokenizer, text: str, flag: str) -> int:
    ids = tokenizer.encode(text)
    if len(ids) != 1:
        raise HookError(f"{flag} {text!r} is {len(ids)} tokens; give text that is one token")
    return ids[0]


def rounded(tensor: torch.Tensor, places: int = 4) -> Any:
    return torch.round(tensor.float() * 10**places).div(10**places).tolist()


@torch.no_grad()
def inspect_prompt(
    model: TransformerLM | Encoder,
    tokenizer: Tokenizer,
    prompt: str | list[int],
    corrupted: str | None = None,
    target: str | None = None,
    foil: str | None = None,
    top_k: int = 5,
    lessons: bool = True,
) -> dict[str, Any]:
    """Patterns, logit lens, residual norms, attribution and (with `corrupted`) patching;
    with `lessons`, also the next-token distribution after the prompt (`next`) and every
    head's attention step by step (`steps`), which the page's panels draw. The prompt is a
    text (read after <|endoftext|>) or token ids (read as they are). An encoder: patterns,
    lens and norms."""
    encoder = isinstance(model, Encoder)
    if encoder and (corrupted or target or foil):
        raise HookError("--corrupted, --target and --foil follow a language model's next token")
    device = placement(model)[0]
    ids = encode_prompt(model, tokenizer, prompt, "clean")
    x = torch.tensor([ids], device=device)
    tokens = [tokenizer.decode([i]) for i in ids]
    if isinstance(prompt, list):  # its text as a text prompt is written: no <|endoftext|> first
        prompt = tokenizer.decode(ids[1:] if ids[0] == tokenizer.eot_id else ids)
    lens = logit_lens(model, x)
    probs, top = lens.top(min(top_k, lens.logprobs.shape[-1]))
    labels = model.config.labels if encoder else None
    words = [
        [[labels[int(i)] if labels else tokenizer.decode([int(i)]) for i in row] for row in depth]
        for depth in top
    ]
    _, stream = residual_stream(model, x)
    kind = ", bidirectional encoder: every query reads every key" if encoder else ""
    data: dict[str, Any] = {
        "model": f"{model.config.n_layers} layers, {model.config.n_heads} heads, "
        f"d_model {model.config.d_model}, {model.config.norm}-norm, {model.config.position}"
        f"{kind}",
        "prompt": prompt,
        "tokens": tokens,
        "patterns": rounded(attention_patterns(model, x)),
        "lens": {
            "depths": lens.labels,
            "k": len(top[0][0]),
            "top": [
                [list(zip(w, p, strict=True)) for w, p in zip(wd, pd.tolist(), strict=True)]
                for wd, pd in zip(words, probs, strict=True)
            ],
        },
        "norms": rounded(stream.float().norm(dim=-1)),
        "target": None,
        "attribution": None,
        "patching": None,
    }
    if encoder:
        return data
    logits = model(x)[0, -1]
    target_id = one_token(tokenizer, target, "--target") if target else int(logits.argmax())
    data["target"] = tokenizer.decode([target_id])
    if lessons:
        data["ids"] = ids
        data["next"] = next_token(tokenizer, logits, places=6)
        data["steps"] = _steps(model, x)
    if model.config.norm == "pre":
        attribution = direct_logit_attribution(model, x, target_id)
        data["attribution"] = {
            "target": data["target"],
            "logit": float(logits[target_id]),
            "labels": attribution.labels,
            "values": rounded(attribution.values),
        }
    if corrupted is not None:
        data["patching"] = _patching(model, tokenizer, x, corrupted, target_id, foil, tokens)
    return data


def next_token(
    tokenizer: Tokenizer,
    logits: torch.Tensor,
    top: int = 20,
    token: int | None = None,
    places: int | None = None,
) -> dict[str, Any]:
    """The model's next-token distribution from one position's logits [V]: every
    log-probability, largest first (`places` rounds them); the `top` likeliest tokens with
    their ids and text; and where `token` ranks. The panels filter it as tlm samples."""
    values, order = logits.float().cpu().log_softmax(dim=-1).sort(descending=True)
    answer: dict[str, Any] = {
        "top": [
            {"id": int(t), "token": tokenizer.decode([int(t)]), "logprob": float(lp)}
            for t, lp in zip(order[:top], values[:top], strict=True)
        ],
        "logprobs": values.tolist() if places is None else rounded(values, places),
    }
    if token is not None:
        rank = int((order == token).nonzero()[0, 0])
        answer["token"] = {"id": token, "token": tokenizer.decode([token]), "rank": rank}
        answer["token"]["logprob"] = float(values[rank])
    return answer


def _steps(model: TransformerLM, x: torch.Tensor) -> dict[str, Any]:
    """Every head's scores before the mask, pattern and ‖v_j‖, [L, H, ...] (6 places)."""
    layers = [attention_steps(model, x, layer) for layer in range(model.config.n_layers)]
    return {
        name: rounded(torch.stack([steps[name] for steps in layers]), 6)
        for name in ("scores", "pattern", "value_norms")
    }


def _patching(model, tokenizer, x, corrupted, target_id, foil, tokens) -> dict[str, Any]:
    bad = torch.tensor([encode_prompt(model, tokenizer, corrupted, "corrupted")], device=x.device)
    foil_id = one_token(tokenizer, foil, "--foil") if foil else None
    labels = [f"{t}: {tok}" for t, tok in enumerate(tokens)]
    sweeps = {
        over: patching_sweep(model, x, bad, target_id, foil_id, over=over, labels=labels)
        for over in ("positions", "heads")
    }
    target = repr(tokenizer.decode([target_id]))
    name = (
        f"u[{target}]" if foil_id is None else f"u[{target}] - u[{tokenizer.decode([foil_id])!r}]"
    )
    return {
        "corrupted": corrupted,
        "metric": name,
        "clean": sweeps["positions"].clean,
        "corrupted_value": sweeps["positions"].corrupted,
        **{
            over: {"rows": s.rows, "columns": s.columns, "recovery": rounded(s.recovery)}
            for over, s in sweeps.items()
        },
    }


def page(package: str) -> str:
    """A package's page.html with the panels both pages share (`panels.js`) inlined where it
    says PANELS: one self-contained file."""
    files = resources.files
    panels = files("tlm.interpret").joinpath("panels.js").read_text(encoding="utf-8")
    template = files(package).joinpath("page.html").read_text(encoding="utf-8")
    return template.replace("/*PANELS*/", panels, 1)


def write_report(data: dict[str, Any], out: Path, layer: int = 0, head: int = 0) -> list[Path]:
    """The PNGs and index.html for `data` (from `inspect_prompt`) in folder `out`."""
    out.mkdir(parents=True, exist_ok=True)
    patterns = torch.tensor(data["patterns"])  # [L, H, T, T]
    tokens = data["tokens"]
    written = [out / "attention.png", out / f"attention-L{layer}H{head}.png"]
    plot_attention(patterns, tokens, written[0])
    plot_attention_grid(patterns[layer, head], tokens, written[1], f"layer {layer}, head {head}")
    lens = data["lens"]
    top_prob = torch.tensor([[cell[0][1] for cell in depth] for depth in lens["top"]])
    top_word = [[cell[0][0] for cell in depth] for depth in lens["top"]]
    written.append(out / "logit-lens.png")
    plot_logit_lens(top_prob, top_word, lens["depths"], tokens, written[-1])
    written.append(out / "residual-norms.png")
    plot_residual_norms(torch.tensor(data["norms"]), lens["depths"], tokens, written[-1])
    if data["patching"] is not None:
        for over in ("positions", "heads"):
            sweep = data["patching"][over]
            written.append(out / f"patching-{over}.png")
            title = f"activation patching over {over}: {data['patching']['metric']} restored"
            recovery = torch.tensor(sweep["recovery"])
            plot_patching(recovery, sweep["rows"], sweep["columns"], written[-1], title)
    template = page("tlm.interpret")
    inline = json.dumps(data, ensure_ascii=False).replace("</", "<\\/")  # safe inside <script>
    written.append(out / "index.html")
    write_text_atomic(written[-1], template.replace("/*DATA*/", inline))
    return written
