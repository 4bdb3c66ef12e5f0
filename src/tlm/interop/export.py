"""`write_hf`: a tlm model -> a directory that Hugging Face `transformers` opens, in the
layout it is given: GPT-2's (`interop/gpt2.py`), GPT-NeoX's (`interop/gptneox.py`) or
Marian's (`interop/marian.py`), or an encoder's as BERT's (`interop/bert.py`). Which
layout a model takes is a row of `tlm.kinds`.

    OUT/config.json              GPT2Config fields (model_type gpt2), or GPT-NeoX's, ...
    OUT/generation_config.json   <|endoftext|> as bos/eos (and <|end|> as eos for chat); not
                                 for an encoder, which does not generate
    OUT/model.safetensors        the weights under GPT-2's names (a tied head is wte)
    OUT/tokenizer.json           the tokenizer, and for BPE also GPT-2's vocab.json + merges.txt
    OUT/tokenizer_config.json, special_tokens_map.json (an encoder's: [CLS] text [SEP] added
                                 as BERT's tokenizer adds them, [MASK] and [PAD] named)
    OUT/chat_template.jinja      the chat template (`tlm/chat.py`), for a run made for chat
    OUT/README.md                the run's model card, when it has one

The directory is written in full under a temporary name and renamed, so a failure leaves
nothing behind; an existing non-empty OUT is never overwritten.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from safetensors.torch import save_file
from tokenizers import AddedToken, decoders, models, processors
from tokenizers import Tokenizer as HFTokenizer
from torch import Tensor

from tlm._version import __version__
from tlm.chat import END, JINJA, SPECIALS, speaks
from tlm.config import ModelConfig
from tlm.interop.gpt2 import HFFormatError
from tlm.io import atomic_path
from tlm.model import Encoder, EncoderDecoder, TransformerLM
from tlm.tokenizer import EOT, BPETokenizer, CharTokenizer, Tokenizer

# a layout's two conversions: (ModelConfig, eot id) -> config.json, and state dict -> tensors
Layout = tuple[
    Callable[[ModelConfig, int], dict[str, Any]],
    Callable[[dict[str, Tensor], ModelConfig], dict[str, Tensor]],
]


def write_hf(
    model: TransformerLM | EncoderDecoder | Encoder,
    tokenizer: Tokenizer,
    out: str | Path,
    layout: Layout,
    card: Path | None = None,
) -> Path:
    """Write `model` and `tokenizer` as a Hugging Face directory at `out` in `layout` (e.g.
    `(gpt2_config, state_to_gpt2)`), with the model card `card` (a file) as its README.md."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise HFFormatError(f"{out} already exists and is not empty; choose a new folder")
    if tokenizer.vocab_size > model.config.vocab_size:
        raise HFFormatError(
            f"the tokenizer has {tokenizer.vocab_size} tokens, the model {model.config.vocab_size}"
        )
    to_config, to_weights = layout  # each refuses, naming the field, what it cannot express
    config = to_config(model.config, tokenizer.eot_id)
    weights = to_weights(model.state_dict(), model.config)
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.exists():
        out.rmdir()  # empty (checked above): the rename below needs the name free
    with atomic_path(out) as tmp:
        tmp.mkdir()
        _write_json(tmp / "config.json", {**config, "tlm_version": __version__})
        if not isinstance(model, Encoder):
            ends = [tokenizer.eot_id] + ([tokenizer.special_id(END)] if speaks(tokenizer) else [])
            generation = {"bos_token_id": tokenizer.eot_id, "eos_token_id": ends}
            _write_json(tmp / "generation_config.json", generation)
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        write_tokenizer_files(tokenizer, tmp, model.config.context_length)
        if card is not None and card.is_file():
            shutil.copyfile(card, tmp / "README.md")
    return out


def write_tokenizer_files(tokenizer: Tokenizer, folder: Path, context_length: int) -> None:
    """tokenizer.json (+ vocab.json and merges.txt for BPE) and the files `AutoTokenizer` reads."""
    if tokenizer.special_id("[CLS]") is not None:  # an encoder's: BERT's conventions
        _write_encoder_tokenizer(tokenizer, folder, context_length)
        return
    if isinstance(tokenizer, BPETokenizer):
        (folder / "tokenizer.json").write_text(tokenizer.to_json(), encoding="utf-8")
        with tempfile.TemporaryDirectory() as scratch:  # vocab.json + merges.txt, GPT-2's files
            for file in tokenizer.tokenizer.model.save(scratch):
                shutil.copyfile(file, folder / Path(file).name)
        tokenizer_class = "GPT2Tokenizer"
    else:
        (folder / "tokenizer.json").write_text(_char_as_hf(tokenizer).to_str(), encoding="utf-8")
        tokenizer_class = "PreTrainedTokenizerFast"
    specials = {"bos_token": EOT, "eos_token": EOT, "unk_token": EOT}
    _write_json(folder / "special_tokens_map.json", specials)
    settings = {
        "tokenizer_class": tokenizer_class,
        **specials,
        "model_max_length": context_length,
        "add_prefix_space": False,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,  # decode must give back the exact text
    }
    if speaks(tokenizer):  # the template transformers' apply_chat_template runs
        settings["extra_special_tokens"] = list(SPECIALS)
        (folder / "chat_template.jinja").write_text(JINJA, encoding="utf-8")
    _write_json(folder / "tokenizer_config.json", settings)


def _write_encoder_tokenizer(tokenizer: Tokenizer, folder: Path, context_length: int) -> None:
    """An encoder's tokenizer as BERT's fast tokenizer is used: `tokenizer(text)` gives
    `[CLS] text [SEP]` (and `[CLS] a [SEP] b [SEP]` with segments 0 and 1 for a pair), the
    ids tlm's encoder reads; [MASK] and [PAD] named for fill-mask pipelines and batches."""
    hf = _as_hf(tokenizer)
    cls, sep = (("[CLS]", tokenizer.special_id("[CLS]")), ("[SEP]", tokenizer.special_id("[SEP]")))
    hf.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[cls, sep]
    )
    (folder / "tokenizer.json").write_text(hf.to_str(), encoding="utf-8")
    specials = {"cls_token": "[CLS]", "sep_token": "[SEP]", "mask_token": "[MASK]"}
    specials |= {"pad_token": "[PAD]", "unk_token": EOT}
    _write_json(folder / "special_tokens_map.json", specials)
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", **specials}
    settings |= {"model_max_length": context_length, "clean_up_tokenization_spaces": False}
    settings["model_input_names"] = ["input_ids", "token_type_ids", "attention_mask"]
    _write_json(folder / "tokenizer_config.json", settings)


def _as_hf(tokenizer: Tokenizer) -> HFTokenizer:
    """Either kind of tokenizer as a `tokenizers` object (a copy)."""
    if isinstance(tokenizer, BPETokenizer):
        return HFTokenizer.from_str(tokenizer.to_json())
    return _char_as_hf(tokenizer)


def _char_as_hf(tokenizer: CharTokenizer) -> HFTokenizer:
    """A character vocabulary as a `tokenizers` BPE with no merges: each character one id."""
    vocab = {char: i for i, char in enumerate(tokenizer.chars)}
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    hf.decoder = decoders.Fuse()  # join the characters back without separators
    specials = tokenizer.specials  # <|endoftext|>, then any others, ids in order
    hf.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    return hf


def _write_json(path: Path, payload: dict) -> None:
    path.write_text(json.dumps(payload, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
