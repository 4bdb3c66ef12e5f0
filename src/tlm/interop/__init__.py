"""Exchanging models with other tools: the Hugging Face GPT-2 format."""

from tlm.interop.gpt2 import HFFormatError, is_hf_model_dir, load_gpt2

__all__ = ["HFFormatError", "is_hf_model_dir", "load_gpt2"]
