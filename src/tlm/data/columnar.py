"""Documents in the columnar files Hugging Face's datasets are published in: Parquet shards
(FineWeb, The Stack, ...) and Arrow files (what `datasets.save_to_disk` writes), one document
per row in a text column. pyarrow reads them a row group or a record batch at a time, so a
shard larger than memory streams through. `pip install "tlm[parquet]"` installs pyarrow.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from tlm.errors import UserError

COLUMNAR = (".parquet", ".arrow")


class ColumnarError(UserError):
    """A columnar file tlm cannot read documents from; the message names it."""


def column_texts(path: Path, name: str, field: str) -> Iterator[str]:
    """The strings of column `field` of a .parquet or .arrow file, row by row (nulls
    skipped); a missing or non-text column, or a corrupt file, is one line."""
    yield from column_values(path, name, field, text=True)


def column_values(path: Path, name: str, fields: str | tuple[str, ...], text: bool = False):
    """The values of a column of a .parquet or .arrow file as Python objects, row by row
    (nulls skipped): the first of `fields` the file has (a list of structs comes as a list
    of dicts); `text` asks for a text column. A missing column, or a corrupt file, is one
    line."""
    try:
        import pyarrow as pa
    except ImportError:
        raise ColumnarError(
            f'{name}: reading {path.suffix} needs pyarrow: pip install "tlm[parquet]"'
        ) from None
    fields = (fields,) if isinstance(fields, str) else fields
    try:
        read = _parquet if path.suffix == ".parquet" else _arrow
        for batch in read(path, lambda schema: _check(schema, name, fields, text)):
            for value in batch.column(0).to_pylist():
                if value is not None:
                    yield value
    except (pa.ArrowException, OSError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ColumnarError(f"{name}: not a readable {path.suffix[1:]} file ({first})") from None


def _parquet(path: Path, check):
    import pyarrow.parquet as pq

    shard = pq.ParquetFile(path)
    field = check(shard.schema_arrow)
    for group in range(shard.num_row_groups):  # one row group in memory at a time
        yield from shard.read_row_group(group, columns=[field]).to_batches()


def _arrow(path: Path, check):
    """An Arrow IPC file, or a stream (the format `datasets.save_to_disk` writes)."""
    import pyarrow as pa

    with pa.memory_map(str(path)) as source:
        try:
            reader = pa.ipc.open_file(source)
            batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
        except pa.ArrowInvalid:
            source.seek(0)
            reader = pa.ipc.open_stream(source)
            batches = iter(reader)
        field = check(reader.schema)
        for batch in batches:
            yield batch.select([field])


def _check(schema, name: str, fields: tuple[str, ...], text: bool) -> str:
    """The first of `fields` in `schema`, which must be a text column if `text`."""
    import pyarrow as pa

    field = next((f for f in fields if f in schema.names), None)
    if field is None:
        columns = ", ".join(schema.names[:8]) or "none"
        wanted = " or ".join(repr(f) for f in fields)
        hint = "; see --text-field" if text else ""
        raise ColumnarError(f"{name}: no column {wanted} (its columns: {columns}){hint}")
    kind = schema.field(field).type
    if text and not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise ColumnarError(f"{name}: column {field!r} holds {kind}, not text")
    return field
