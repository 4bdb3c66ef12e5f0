"""The one base class of every error that is the user's input, not a bug in tlm.

`tlm` commands print these as one line (`tlm: error: ...`) and exit 2; anything else is a
bug and keeps its traceback. Library users can catch `UserError` to catch them all. This
module imports nothing, so the command line can name it without loading PyTorch.
"""


class UserError(ValueError):
    """Input that cannot be used; the message says which and why, in one line."""
