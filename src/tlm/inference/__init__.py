"""What makes a trained model fast: packed weight formats and their kernels, the BLAS route
for one row, the slot cache of continuous batching, and the model built from them.

The math (`tlm.model`) knows none of this: `for_inference` and `load_prepared` build an
`InferenceLM` from a trained model (`modules.py` lists every method it overrides), and the
slot cache keeps the model's `Cache` interface.
"""

from tlm.inference.decoding.decoder import Decoder
from tlm.inference.formats.kernels import FORMATS, check_format
from tlm.inference.formats.modules import InferenceLM
from tlm.inference.formats.prepare import for_decoding, for_inference, in_parts, load_prepared
from tlm.inference.slot_cache import SlotCache, SlotPass

__all__ = [
    "FORMATS",
    "Decoder",
    "InferenceLM",
    "SlotCache",
    "SlotPass",
    "check_format",
    "for_decoding",
    "for_inference",
    "in_parts",
    "load_prepared",
]
