"""`GenerationError`: a decoding setting that cannot be used. Every module of `generate/`
raises it (the settings, the chooser, the grammar, the loops), so it sits below them all."""

from tlm.errors import UserError


class GenerationError(UserError):
    """A decoding setting that cannot be used; the message names the value."""
