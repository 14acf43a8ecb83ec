"""The byte engine: the one place where checkpoint bytes are read, transformed and handed to sinks.

:mod:`.io` is the one read helper (``pread``/``preadv`` until full, the one block size and the
per-thread block buffers); :mod:`.pool` the one thread pool of the process; :mod:`.plan` the
vocabulary of byte work (windows read, an optional slab transform, sinks: write at an offset,
CRC-32, digest update, compare) and :mod:`.execute` its one executor; :mod:`.crc` the CRC-32 of
zip entries. Everything above it — the chunk reader, verbatim copies, export, reshard,
``validate --deep``, diff, manifest, replay — reads through it (``docs/design.md`` §5).
It imports nothing of ckpttool but :mod:`ckpttool.errors`.
"""
