"""Decoding: pgoutput messages (LSN, bytes) into whole transactions of Arrow rows, with no
connection and no file of its own (:mod:`.range_decoder`; :mod:`.pgoutput` is the per-message
reference, :mod:`.pgoutput_batch` its vectorised form).

Invariant kept here: a range holds the transactions whose COMMIT ends in it, whole; an endpos
between or inside transactions never moves a watermark past the last complete commit.
"""
