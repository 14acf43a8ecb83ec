"""The byte engine: the one place where checkpoint bytes are read, transformed and handed to sinks.

:mod:`.io` is the one read helper (``pread``/``preadv`` until full, the one block size and the
per-thread block buffers). Everything above it — the chunk reader, verbatim copies, export,
reshard, ``validate --deep``, diff, manifest, replay — reads through it (``docs/design.md`` §5).
It imports nothing of ckpttool but :mod:`ckpttool.errors`.
"""
