"""What a trained model would give back of its training data (J&M §10.10): discoverable
memorization on training against held-out windows, against how often each window's text
is duplicated in the training split, and the exposure of canaries planted by `tlm
prepare --canary-repeats`.
"""

from tlm.audit.canaries import Exposure, exposure, extracted, text_logprobs
from tlm.audit.duplication import by_bucket, occurrences
from tlm.audit.extraction import AuditError, Extraction, extraction, wilson
from tlm.audit.report import audit, passes, record

__all__ = [
    "AuditError",
    "Exposure",
    "Extraction",
    "audit",
    "by_bucket",
    "exposure",
    "extracted",
    "extraction",
    "occurrences",
    "passes",
    "record",
    "text_logprobs",
    "wilson",
]
