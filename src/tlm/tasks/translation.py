"""Scoring translations: BLEU and chrF by sacrebleu, the field's reference implementation.

`evaluate_translation` translates each source sentence of a test set (beam search, as
`tlm.generate.translate`) and scores the outputs against the references with sacrebleu's
defaults (BLEU: 13a tokenization, 4-grams, brevity penalty; chrF: character 6-grams,
β = 2), the numbers papers report for Multi30k.
"""

from __future__ import annotations

import time
from typing import Any

from tlm.data.pairs import read_pairs
from tlm.generate.translate import translate
from tlm.model.encoder_decoder import EncoderDecoder
from tlm.tokenizer import Tokenizer


def corpus_scores(hypotheses: list[str], references: list[str]) -> dict[str, float]:
    """BLEU and chrF of the hypotheses against one reference each (sacrebleu defaults)."""
    import sacrebleu  # 0.2 s of imports, only when scoring

    bleu = sacrebleu.corpus_bleu(hypotheses, [references])
    chrf = sacrebleu.corpus_chrf(hypotheses, [references])
    return {"bleu": bleu.score, "chrf": chrf.score, "bleu_signature": str(bleu)}


def evaluate_translation(
    model: EncoderDecoder,
    tokenizer: Tokenizer,
    src: str,
    ref: str,
    beams: int = 4,
    alpha: float = 0.6,
    batch_size: int = 64,
    examples: int = 0,
) -> dict[str, Any]:
    """Translate file `src` line by line and score against file `ref`: BLEU, chrF, the pair
    count (pairs with an empty side are skipped and counted), speed, and the first
    `examples` translations beside their sources and references."""
    sources, references, skipped = read_pairs(src, ref)
    started = time.perf_counter()
    hypotheses = translate(model, tokenizer, sources, beams, alpha, batch_size)
    seconds = time.perf_counter() - started
    results = corpus_scores(hypotheses, references)
    results |= {"pairs": len(sources), "skipped_empty": skipped, "beams": beams}
    results |= {"alpha": alpha, "seconds": round(seconds, 2)}
    results["examples"] = [
        {"source": s, "translation": h, "reference": r}
        for s, h, r in list(zip(sources, hypotheses, references, strict=True))[:examples]
    ]
    return results
