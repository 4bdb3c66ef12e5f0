"""The weight formats and their packing: the kernels each format's products run through
(`kernels.py`, with tlm's blocked layouts in `blocked.py` and one fp32 row in `blas.py`),
the model's modules that call them (`modules.py`: `InferenceLM`), and the building of such a
model from a trained one or while its weights are read (`prepare.py`)."""
