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
    try:
        import pyarrow as pa
    except ImportError:
        raise ColumnarError(
            f'{name}: reading {path.suffix} needs pyarrow: pip install "tlm[parquet]"'
        ) from None
    try:
        batches = (
            _parquet(path, name, field) if path.suffix == ".parquet" else _arrow(path, name, field)
        )
        for batch in batches:
            for text in batch.column(0).to_pylist():
                if text is not None:
                    yield text
    except (pa.ArrowException, OSError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ColumnarError(f"{name}: not a readable {path.suffix[1:]} file ({first})") from None


def _parquet(path: Path, name: str, field: str):
    import pyarrow.parquet as pq

    shard = pq.ParquetFile(path)
    _check(shard.schema_arrow, name, field)
    for group in range(shard.num_row_groups):  # one row group in memory at a time
        yield from shard.read_row_group(group, columns=[field]).to_batches()


def _arrow(path: Path, name: str, field: str):
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
        _check(reader.schema, name, field)
        for batch in batches:
            yield batch.select([field])


def _check(schema, name: str, field: str) -> None:
    import pyarrow as pa

    if field not in schema.names:
        columns = ", ".join(schema.names[:8]) or "none"
        raise ColumnarError(
            f"{name}: no column {field!r} (its columns: {columns}); see --text-field"
        )
    kind = schema.field(field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise ColumnarError(f"{name}: column {field!r} holds {kind}, not text")
