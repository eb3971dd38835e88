"""The decoded output store: one Parquet folder per LSN range with its manifest, the chain of
ranges from the base snapshot on (:mod:`.output_store`), and retention (:mod:`.retention`).

Invariant kept here: a range exists only whole (written, synced, then renamed into place), and
its manifest is the one record of what it holds; a range is removed only once applied.
"""
