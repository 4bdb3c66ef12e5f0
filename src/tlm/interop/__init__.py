"""Exchanging models with other tools: Hugging Face's GPT-2, GPT-NeoX and Marian layouts."""

from tlm.interop.gpt2 import HFFormatError, is_hf_model_dir, load_gpt2
from tlm.interop.hf import load_hf

__all__ = ["HFFormatError", "is_hf_model_dir", "load_gpt2", "load_hf"]
