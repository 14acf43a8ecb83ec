"""The operations: each takes an opened :class:`~ckpttool.model.checkpoint.Checkpoint` and options, returns a result.

One package or module per command (:mod:`.inspect`, :mod:`.validate`, :mod:`.export`,
:mod:`.reshard`, :mod:`.stamp`, :mod:`.replay`, :mod:`.sample`, :mod:`.diff`, :mod:`.manifest`,
:mod:`.stats`, :mod:`.import_hf`): planning is pure and
testable without data, the I/O apart, every result a frozen dataclass with ``to_dict()``.
Nothing here prints; the CLI renders the results.
"""
