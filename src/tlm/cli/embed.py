"""`tlm embed`: an encoder's contextual embeddings of texts (§11.3), and their anisotropy."""

from __future__ import annotations

import argparse
from pathlib import Path

from tlm.cli.args import add_command, add_model_flags, fail, model_device

EXAMPLE = """examples:
  tlm embed runs/demo-encoder/mlm docs.txt --out vectors.npy            # one text a line
  tlm embed runs/encoder notes.jsonl --out vectors.parquet --pool cls   # a "text" field
  tlm embed runs/encoder docs.txt --out vectors.npy --anisotropy        # + per-layer cosine

Each text is read as `[CLS] text [SEP]` (cut to the model's context) and pooled: the mean
over its positions (--pool mean, the default) or the vector at [CLS]. .npy holds [N, d]
float32 in the texts' order; .parquet a `text` and an `embedding` column. --anisotropy
prints the mean cosine between random words of different texts at each layer and plots it.
"""


def register(sub: argparse._SubParsersAction) -> None:
    parser = add_command(sub, "embed", "contextual embeddings of texts (an encoder run)", EXAMPLE)
    parser.add_argument("run", help="run directory of an encoder")
    parser.add_argument("files", nargs="+", help="texts: .txt (one a line), .jsonl or .parquet")
    parser.add_argument("--out", required=True, help="FILE.npy or FILE.parquet")
    parser.add_argument("--pool", choices=("mean", "cls"), default="mean", help="mean (default)")
    parser.add_argument("--text-field", default="text", help="JSONL field of the text")
    parser.add_argument("--anisotropy", action="store_true", help="per-layer mean cosine")
    parser.add_argument("--plot", help="the anisotropy plot (default: next to --out)")
    add_model_flags(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from tlm.interpret.plots import plot_anisotropy
    from tlm.io import atomic_path
    from tlm.load import load_encoder, load_tokenizer, source_of
    from tlm.tasks.embed import anisotropy, embed_texts
    from tlm.tasks.inputs import read_examples

    out = Path(args.out)
    if out.suffix not in (".npy", ".parquet"):
        fail("--out names a .npy or a .parquet file")
    texts = [t for f in args.files for t, _ in read_examples(f, args.text_field, None) if t.strip()]
    source = source_of(args.run)
    model, tokenizer = (
        load_encoder(source, model_device(args), args.weights),
        load_tokenizer(source),
    )
    vectors = embed_texts(model, tokenizer, texts, args.pool)
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(out) as tmp:
        _write(vectors, texts, tmp, out.suffix)
    print(f"{len(texts):,} texts -> {out} ({vectors.shape[0]} x {vectors.shape[1]}, {args.pool})")
    if args.anisotropy:
        values = anisotropy(model, tokenizer, texts)
        names = ["input", *(f"block {b}" for b in range(len(values) - 1))]
        print("anisotropy, mean cosine of random words of different texts:")
        for name, value in zip(names, values, strict=True):
            print(f"  {name:9s} {value:.3f}")
        plot = Path(args.plot) if args.plot else out.with_suffix(".anisotropy.png")
        plot_anisotropy(values, plot)
        print(f"plot: {plot}")
    return 0


def _write(vectors, texts: list[str], path: Path, suffix: str) -> None:
    if suffix == ".npy":
        import numpy as np

        with open(path, "wb") as f:
            np.save(f, vectors)
        return
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        fail('writing .parquet needs pyarrow: pip install "tlm[parquet]"')
    table = pa.table({"text": texts, "embedding": [list(map(float, v)) for v in vectors]})
    pq.write_table(table, path)
