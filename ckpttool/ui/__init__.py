"""What the command line shows: shared Typer options and value parsers (:mod:`.options`), the one
output sink (:mod:`.output`: JSON or human text, escaping, error/warning lines, logging) and the
formatters and tables (:mod:`.render`). Used by :mod:`ckpttool.commands` and :mod:`ckpttool.cli`;
the library below never imports it (``docs/design.md`` §5).
"""
