"""The decoding step and its program: the `Decoder` a decoding loop holds (`decoder.py`), the
step between the products in C (`step.py`) and the whole step described for one C call
(`program.py`)."""
