"""A range on an object store read by Spark's executors themselves, with pyarrow.

Spark's own Parquet reader runs on the JVM, which reads ``s3a://`` only with Hadoop's AWS
module and the AWS SDK on every executor (jars pip does not ship). pyarrow, which the
executors' Python has anyway (the kernel is pyarrow), reads S3 by itself: one task per file
opens it with pyarrow's S3 file system and hands its batches to Spark (``mapInArrow``).

What goes to the executors is the file's URL and the endpoint and region
(:func:`~..store.objects.reader_options`), never a credential: an executor takes its
credentials from its own AWS chain (``spark.executorEnv.AWS_*``, an instance role).
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import pyarrow as pa

from ..store.objects import reader_filesystem, reader_options
from ..store.range_format import CHANGE_SCHEMA

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

BATCH_ROWS = 65_536


def is_object_url(path: str) -> bool:
    return path.startswith("s3://")


def object_frame(spark: SparkSession, urls: Sequence[str]) -> DataFrame:
    """The changes of the Parquet files at ``urls`` (``s3://bucket/key``), read by the
    executors, typed as :data:`~..store.range_format.CHANGE_SCHEMA`."""
    from pyspark.sql.pandas.types import from_arrow_schema

    options = reader_options()
    files = spark.createDataFrame([(url,) for url in urls], "url string")
    files = files.repartition(max(1, len(urls)))

    def read(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        import pyarrow.parquet as pq

        fs = reader_filesystem(options)
        for batch in batches:
            for url in batch.column("url").to_pylist():
                with pq.ParquetFile(fs.open_input_file(str(url).removeprefix("s3://"))) as f:
                    for rows in f.iter_batches(batch_size=BATCH_ROWS):
                        table = pa.Table.from_batches([rows])
                        if not table.schema.equals(CHANGE_SCHEMA):
                            table = table.cast(CHANGE_SCHEMA)
                        yield from table.to_batches()

    return files.mapInArrow(read, from_arrow_schema(CHANGE_SCHEMA))


def probe_paths(paths: Sequence[str]) -> list[str]:
    """``paths`` as the executors' check reads them (:mod:`..spark.probe`): an object's URL
    with the reader's options as its query."""
    query = urllib.parse.urlencode(reader_options())
    return [f"{p}?{query}" if is_object_url(p) and query else p for p in paths]
