"""llama.cpp on tlm's GGUF files (not a test): the same text, the same continuations, the same
perplexity, and decoding speed beside tlm's, in one run.

    make demo && python bench/gguf.py                 # the demo's model and its data
    python bench/gguf.py --run RUN --data DATA        # any trained run
    python bench/gguf.py --run runs/demo-chat --data data/demo-chat   # also chat (tlm demo chat)
    python bench/gguf.py --gpt2                       # also decode speed, GPT-2 124M shape

`tlm export-gguf` writes the run as f32, f16, q8_0, q4_0, q4_k and q4_k_m; llama.cpp reads
each through `llama-cpp-python` (PyPI's package, compiled here for this CPU, about 6 minutes
on 2 cores, the first time only: it is installed under --work, one folder per CPU's flags).

0. Quantizer: llama.cpp's own Q4_K_M of the f32 file against tlm's q4_k_m file, matrix by
   matrix: the same type, and the share of blocks byte for byte the same.
1. Tokens: llama.cpp's gpt2 tokenizer on the validation text gives tlm's ids.
2. Greedy: 64 new tokens after a 32-token prompt from the validation split, llama.cpp's
   (every type) against tlm's float32 `generate` and tlm's in the format of the same name
   (for q4_k_m, which tlm has no format of, and for llama.cpp's own Q4_K_M file: tlm reading
   the file, its blocks dequantized); where they part, the position.
3. Perplexity on the first --tokens of the validation split, in the windows `tlm eval`
   scores (context-length windows, each token a target once): tlm's `evaluate_tokens`
   (what `tlm eval` prints) and llama.cpp's logits of the same windows.
4. Chat (a run fine-tuned on conversations, with its prepared --data): llama.cpp's
   `create_chat_completion`, which renders the GGUF's `tokenizer.chat_template` itself and
   stops at its end token, against tlm's reply (`tlm chat`), greedy, on the first
   --questions held-out conversations, every type.
5. Decoding, batch 1: 1-token prompt, 128 new tokens (the demo: up to its context), greedy;
   tlm `load_model(path, dtype=...)` + `generate` against llama.cpp's `eval` one token at a
   time, alternating, best of --rounds: each GGUF type against tlm's format of the same
   name (f32, f16: float32, float16), and q8_0 also against tlm's int8.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
from _llama import llama_cpp
from _peers import host

from tlm import ModelConfig, TransformerLM, load_model, load_tokenizer
from tlm.data import TokenData, eval_windows
from tlm.evaluate import evaluate_tokens
from tlm.generate import generate
from tlm.interop.gguf import export_gguf
from tlm.tokenizer import train_tokenizer

ROOT = Path(__file__).resolve().parent.parent
TYPES = {"f32": "float32", "f16": "float16", "q8_0": "q8_0", "q4_0": "q4_0", "q4_k": "q4_k"}
TYPES["q4_k_m"] = None  # llama.cpp's mix: tlm has no format of that name, llama.cpp runs alone
ALSO = {"q8_0": ["int8"]}  # tlm's other formats timed beside a type (int8: a scale a row)
GPT2 = {"vocab_size": 50257, "d_model": 768, "n_layers": 12, "n_heads": 12, "context_length": 1024}


def write_files(model: TransformerLM, tokenizer, folder: Path, name: str) -> dict[str, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    files = {}
    for kind in TYPES:
        path = folder / f"{name}-{kind}.gguf"
        path.unlink(missing_ok=True)  # the run may have changed since the last bench
        files[kind] = export_gguf(model, tokenizer, path, kind)
    return files


def open_llama(llama, path: Path, context: int, threads: int, all_logits: bool = False):
    return llama.Llama(
        str(path), n_ctx=context, n_batch=context, n_threads=threads, n_threads_batch=threads,
        logits_all=all_logits, verbose=False,
    )  # fmt: skip


def last_logits(llama, llm) -> np.ndarray:
    """The logits after the last token `llm` evaluated, read from llama.cpp's own buffer."""
    return np.ctypeslib.as_array(llama.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))


def llama_greedy(llama, llm, prompt: list[int], new: int) -> list[int]:
    """`new` greedy tokens after `prompt`, one llama.cpp decode per token."""
    llm.reset()
    llm.eval(prompt)
    out = [int(np.argmax(last_logits(llama, llm)))]
    while len(out) < new:
        llm.eval(out[-1:])
        out.append(int(np.argmax(last_logits(llama, llm))))
    return out


def llama_nll(llm, windows: list[np.ndarray]) -> tuple[float, int]:
    """Summed negative log-likelihood of each window's tokens after the first, and the count."""
    total, count = 0.0, 0
    for window in windows:
        llm.reset()
        llm.eval(window[:-1].tolist())
        logits = np.asarray(llm.scores[: len(window) - 1], dtype=np.float64)
        top = logits.max(axis=1, keepdims=True)
        logz = np.log(np.exp(logits - top).sum(axis=1)) + top[:, 0]
        total += float((logz - logits[np.arange(len(logits)), window[1:]]).sum())
        count += len(window) - 1
    return total, count


def part_agreement(llama, run: Path, data: Path, files, tokens: int, threads: int) -> None:
    model, tokenizer = load_model(run), load_tokenizer(run)
    T = model.config.context_length
    val = TokenData(data).split("val")
    text = tokenizer.decode(val[: min(len(val), 4096)].tolist())
    llm = open_llama(llama, files["f32"], T, threads)
    theirs = llm.tokenize(text.encode(), add_bos=False, special=True)
    same = theirs == tokenizer.encode(text)
    verdict = "yes" if same else "NO"
    print(
        f"tokens: llama.cpp's of {len(text):,} characters of validation text equal tlm's: {verdict}"
    )
    prompt = val[:32].tolist()
    new = min(64, T - len(prompt))
    ours = model.generate(torch.tensor([prompt]), max_new_tokens=new)[0, len(prompt) :].tolist()
    windows = [w.numpy() for chunk in eval_windows(val, T, tokens) for w in chunk]
    scored = evaluate_tokens(model, val, tokenizer.token_bytes(), max_tokens=tokens)
    print(
        f"greedy: {new} new tokens after a 32-token validation prompt; perplexity: the "
        f"first {scored['tokens']:,} validation tokens in {len(windows)} windows of {T}"
    )
    print(f"tlm float32 (tlm eval): perplexity {scored['perplexity']:.4f}")
    print(
        "llama.cpp  same greedy tokens: as tlm float32 / tlm in its format (where they part: "
        "llama.cpp's top-two gap)   perplexity   vs tlm float32   tlm in its format   vs it"
    )
    for kind, path in files.items():
        llm = open_llama(llama, path, T, threads, all_logits=True)
        greedy = llama_greedy(llama, llm, prompt, new)
        total, count = llama_nll(llm, windows)
        ppl = math.exp(total / count)
        line = f"{kind:10s} {agreement(greedy, ours):>27s} / "
        # tlm's own format of the same weights; for a type tlm has no format of, the file
        # itself read into tlm (each block dequantized to fp32 as the gguf package does)
        packed = load_model(path) if TYPES.get(kind) is None else load_model(run, dtype=TYPES[kind])
        own = packed.generate(torch.tensor([prompt]), max_new_tokens=new)[0, len(prompt) :]
        own_ppl = evaluate_tokens(packed, val, tokenizer.token_bytes(), max_tokens=tokens)
        print(
            f"{line}{parting(llama, llm, prompt, greedy, own.tolist()):<26s} {ppl:12.4f} "
            f"{ppl / scored['perplexity'] - 1:+13.2%} "
            f"{own_ppl['perplexity']:19.4f} {ppl / own_ppl['perplexity'] - 1:+7.2%}"
        )


def part_quantizer(llama, files, work: Path) -> Path:
    """llama.cpp's own quantizer (`llama_model_quantize`, Q4_K_M) on the f32 file, against
    `tlm export-gguf --type q4_k_m`: the type of each matrix, and the share of its blocks
    whose bytes are the same. Returns llama.cpp's file (part 2 reads it into tlm)."""
    import ctypes

    from gguf import GGML_QUANT_SIZES, GGUFReader

    params = llama.llama_model_quantize_default_params()
    params.ftype, params.nthread = llama.LLAMA_FTYPE_MOSTLY_Q4_K_M, torch.get_num_threads()
    out = work / "llama-q4_k_m.gguf"
    out.unlink(missing_ok=True)
    if llama.llama_model_quantize(
        str(files["f32"]).encode(), str(out).encode(), ctypes.byref(params)
    ):
        raise SystemExit("llama.cpp could not quantize the f32 file")
    theirs = {t.name: t for t in GGUFReader(out).tensors if len(t.shape) == 2}
    ours = {t.name: t for t in GGUFReader(files["q4_k_m"]).tensors if len(t.shape) == 2}
    same_type, blocks = 0, {}
    for name, mine in ours.items():
        kind = mine.tensor_type
        if kind != theirs[name].tensor_type or kind.name == "F32":
            same_type += kind == theirs[name].tensor_type
            continue
        size = GGML_QUANT_SIZES[kind][1]
        a, b = (np.asarray(t.data).view(np.uint8).reshape(-1, size) for t in (mine, theirs[name]))
        equal, total = blocks.get(kind.name, (0, 0))
        blocks[kind.name] = (equal + int(np.all(a == b, axis=1).sum()), total + len(a))
        same_type += 1
    shares = ", ".join(f"{k} {e / t:.1%} of {t:,}" for k, (e, t) in sorted(blocks.items()))
    print(f"q4_k_m against llama.cpp's own quantizer of the f32 file: the same type for "
          f"{same_type}/{len(ours)} matrices; blocks byte for byte the same: {shares}")  # fmt: skip
    return out


def parting(llama, llm, prompt: list[int], theirs: list[int], ours: list[int]) -> str:
    """`agreement`, and where they part, how far apart llama.cpp's two best logits were
    there (a near-tie: a gap smaller than the two sides' difference in arithmetic)."""
    said = agreement(theirs, ours)
    parted = next((i for i, (a, b) in enumerate(zip(theirs, ours, strict=True)) if a != b), None)
    if parted is None:
        return said
    llm.reset()
    llm.eval(prompt + theirs[:parted])
    top = np.sort(last_logits(llama, llm))[-2:]
    return f"{said}, gap {top[1] - top[0]:.3f}"


def agreement(theirs: list[int], ours: list[int]) -> str:
    """`n/n` where two greedy continuations agree throughout, else where they part."""
    parted = next((i for i, (a, b) in enumerate(zip(theirs, ours, strict=True)) if a != b), None)
    return f"{len(ours)}/{len(ours)}" if parted is None else f"first {parted}/{len(ours)}"


def part_chat(llama, run: Path, data: Path, files, questions: int, threads: int) -> None:
    """llama.cpp's chat completion against tlm's reply to the same held-out conversations."""
    from tlm.chat import speaks
    from tlm.data import ChatData, open_data
    from tlm.generate import GenerationConfig
    from tlm.generate.chat import chat_prompt, replies, reply_room
    from tlm.tasks.chat import asked, held_out

    model, tokenizer = load_model(run).eval(), load_tokenizer(run)
    chats = open_data(data)
    if not speaks(tokenizer) or not isinstance(chats, ChatData):
        print("chat: skipped (not a run made for chat with its conversations as --data)")
        return
    T, config = model.config.context_length, GenerationConfig(max_new_tokens=48)
    asks = [asked(c)[0] for c in held_out(chats, "val", questions)]
    prompts = [chat_prompt(m, tokenizer, T, reply_room(config.max_new_tokens, T)) for m in asks]
    ours = replies(model, tokenizer, prompts, config)
    print(f"chat: {len(asks)} held-out questions, greedy, at most 48 tokens a reply")
    print("llama.cpp  same reply as tlm chat   both ended their turn")
    for kind, path in files.items():
        llm = open_llama(llama, path, T, threads)
        same = ended = 0
        for messages, mine in zip(asks, ours, strict=True):
            got = llm.create_chat_completion(
                messages=messages, max_tokens=48, temperature=0.0, top_k=1
            )["choices"][0]
            same += got["message"]["content"] == mine.text
            ended += (got["finish_reason"] == "stop") == (mine.finish_reason == "eos")
        print(f"{kind:10s} {same:>14d}/{len(asks)} {ended:>16d}/{len(asks)}")


def decode_rate_llama(llama, llm, new: int) -> float:
    """tok/s of `new` greedy steps after the first token (the prompt's pass excluded)."""
    llm.reset()
    llm.eval([1])
    token = int(np.argmax(last_logits(llama, llm)))
    started = time.perf_counter()
    for _ in range(new):
        llm.eval([token])
        token = int(np.argmax(last_logits(llama, llm)))
    return new / (time.perf_counter() - started)


def decode_rate_tlm(model: TransformerLM, new: int) -> float:
    ids = torch.tensor([[1]])
    stamps = [time.perf_counter() for _ in generate(model, ids, max_new_tokens=new + 1)]
    return new / (stamps[-1] - stamps[0])


def part_speed(llama, label: str, source, files, new: int, rounds: int, threads: int) -> None:
    """tok/s after the first token (each side's first token, the prompt's pass, excluded)."""
    print(f"{label}: batch 1, 1-token prompt, {new} new tokens, greedy; tok/s, best of {rounds}")
    print("llama.cpp  tlm        llama.cpp tok/s   tlm tok/s   tlm / llama.cpp")
    for kind, path in files.items():
        if TYPES[kind] is None:  # llama.cpp alone
            llm = open_llama(llama, path, min(1024, new + 2), threads)
            decode_rate_llama(llama, llm, 4)
            peer = max(decode_rate_llama(llama, llm, new) for _ in range(rounds))
            print(f"{kind:10s} {'-':10s} {peer:15.1f}")
            continue
        for fmt in [TYPES[kind], *ALSO.get(kind, [])]:
            model = load_model(source, dtype=fmt)
            context = min(model.config.context_length, new + 2)
            llm = open_llama(llama, path, context, threads)
            decode_rate_llama(llama, llm, 4), decode_rate_tlm(model, 4)
            ours, theirs = [], []
            for _ in range(rounds):
                theirs.append(decode_rate_llama(llama, llm, new))
                ours.append(decode_rate_tlm(model, new))
            mine, peer = max(ours), max(theirs)
            print(f"{kind:10s} {fmt:10s} {peer:15.1f} {mine:11.1f} {mine / peer:13.2f}x")


def gpt2_shape(work: Path) -> tuple[Path, dict[str, Path]]:
    """A run directory of random GPT-2 124M-shape weights (tanh GELU, as llama.cpp's gpt2),
    its vocabulary a small BPE padded to 50,257 rows, and its GGUF files."""
    from tlm.checkpoint import save_weights, write_config

    folder = work / "gpt2-124m-run"
    if not (folder / "model.safetensors").is_file():
        from pydoc_data.topics import topics

        torch.manual_seed(0)
        model = TransformerLM(ModelConfig(**GPT2, position="learned", activation="gelu_tanh"))
        folder.mkdir(parents=True, exist_ok=True)
        save_weights(folder / "model.safetensors", model)
        write_config(folder, model.config, {})
        train_tokenizer("bpe", list(topics.values()), 1024).save(folder / "tokenizer.json")
    model, tokenizer = load_model(folder), load_tokenizer(folder)
    return folder, write_files(model, tokenizer, work / "gguf", "gpt2-124m")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", type=Path, default=ROOT / "runs" / "demo")
    parser.add_argument("--data", type=Path, default=ROOT / "data" / "demo")
    parser.add_argument("--tokens", type=int, default=8192, help="validation tokens scored")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--questions", type=int, default=32, help="held-out chats (part 4)")
    parser.add_argument("--gpt2", action="store_true", help="decode speed, GPT-2 124M shape")
    parser.add_argument("--work", type=Path, default=ROOT / "out" / "bench")
    args = parser.parse_args()
    here = Path(__file__).resolve().parent  # this file is gguf.py: the gguf package comes first
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here] + [str(here)]
    if not (args.run / "config.json").is_file():
        raise SystemExit(f"no run at {args.run}: run `make demo` first, or give --run and --data")
    threads = torch.get_num_threads()
    llama = llama_cpp(args.work)
    print(f"{host()}, {threads} threads; llama-cpp-python {llama.__version__}")
    files = write_files(load_model(args.run), load_tokenizer(args.run), args.work / "gguf", "run")
    theirs = {"llama q4km": part_quantizer(llama, files, args.work / "gguf")}
    part_agreement(llama, args.run, args.data, files | theirs, args.tokens, threads)
    part_chat(llama, args.run, args.data, files, args.questions, threads)
    new = min(128, load_model(args.run).config.context_length - 2)
    part_speed(llama, str(args.run), args.run, files, new, args.rounds, threads)
    if args.gpt2:
        folder, gpt2_files = gpt2_shape(args.work)
        part_speed(llama, "GPT-2 124M shape", folder, gpt2_files, 128, args.rounds, threads)


if __name__ == "__main__":
    main()
