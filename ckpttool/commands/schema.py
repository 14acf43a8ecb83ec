"""``ckpttool schema CMD``: print the JSON Schema of a command's ``--json`` document.

The schemas ship in the package (``ckpttool/schemas/*.schema.json``, JSON Schema draft
2020-12), one per document id: ``ckpttool.inspect/1``, ``ckpttool.validate/1``,
``ckpttool.export/1``, ``ckpttool.reshard/1``, ``ckpttool.stamp/1``, ``ckpttool.replay/1``,
``ckpttool.rules/1``, ``ckpttool.diff/1``, ``ckpttool.manifest/1``, ``ckpttool.manifest-check/1``, ``ckpttool.stats/1``. Documents may gain fields within a version; consumers ignore
fields they do not know.
"""

from __future__ import annotations

import json
from enum import Enum
from typing import Annotated, Any

import typer

from ckpttool.ui.options import examples
from ckpttool.ui.output import command_boundary, writing_stdout

__all__ = ["SCHEMA_NAMES", "load_schema", "schema_command"]

#: ``ckpttool schema NAME`` -> the document id it describes.
SCHEMA_NAMES = {
    "inspect": "ckpttool.inspect/1",
    "validate": "ckpttool.validate/1",
    "export": "ckpttool.export/1",
    "reshard": "ckpttool.reshard/1",
    "stamp": "ckpttool.stamp/1",
    "replay": "ckpttool.replay/1",
    "rules": "ckpttool.rules/1",
    "diff": "ckpttool.diff/1",
    "manifest": "ckpttool.manifest/1",
    "manifest-check": "ckpttool.manifest-check/1",
    "import": "ckpttool.import/1",
    "stats": "ckpttool.stats/1",
}
_PRINTED_BY = {
    "inspect": "ckpttool inspect --json",
    "validate": "ckpttool validate --json",
    "export": "ckpttool export --json",
    "reshard": "ckpttool reshard --json",
    "stamp": "ckpttool stamp --json",
    "replay": "ckpttool replay-step --json",
    "rules": "ckpttool rules --json, ckpttool validate --list-rules --json",
    "diff": "ckpttool diff --json",
    "manifest": "ckpttool manifest --json",
    "manifest-check": "ckpttool manifest --verify --json",
    "import": "ckpttool import --json",
    "stats": "ckpttool stats --json",
}


#: ``NAME`` choices: :data:`SCHEMA_NAMES`, with ``replay-step`` (the command's name) beside ``replay``
SchemaName = Enum(  # type: ignore[misc]  # built from SCHEMA_NAMES
    "SchemaName",
    {c: c for n in SCHEMA_NAMES for c in ((n, "replay-step") if n == "replay" else (n,))},
    type=str,
)


def load_schema(name: str) -> dict[str, Any]:
    """The JSON Schema (a dict) of ``ckpttool NAME --json`` (``replay-step`` = ``replay``)."""
    from importlib import resources

    name = "replay" if name == "replay-step" else name
    text = (resources.files("ckpttool") / "schemas" / f"{name}.schema.json").read_text(encoding="utf-8")
    doc: dict[str, Any] = json.loads(text)
    return doc


@command_boundary
def schema_command(
    name: Annotated[
        SchemaName | None,
        typer.Argument(
            help="Which document: inspect, validate, export, reshard, stamp, replay (= replay-step), rules, diff, manifest, manifest-check (what manifest prints when verifying), import or stats; "
            "none: list them.",
            show_default=False,
        ),
    ] = None,
    json_output: Annotated[
        bool,
        typer.Option(
            "--json",
            help="Accepted as before the command (ckpttool --json schema NAME): a schema is JSON anyway; the list "
            "(no NAME) is a table and refuses it.",
        ),
    ] = False,
) -> None:
    """Print the JSON Schema of a command's --json output (shipped in the package)."""
    import sys

    if name is None:
        from ckpttool.errors import UsageError
        from ckpttool.ui.render import UI, Col, print_table, stdout_console

        if UI.json or json_output:  # `ckpttool --json schema`: the list is a table, never a JSON document
            raise UsageError(
                "`ckpttool schema` without NAME lists the schemas as a table, not as a JSON document",
                hint="name one for JSON (`ckpttool schema inspect` prints the JSON Schema of inspect's document), "
                "or list them without JSON output",
            )

        with writing_stdout():
            print_table(
                stdout_console(),
                "JSON schemas (ckpttool schema NAME)",
                [Col("name", "code"), Col("document", "code"), Col("printed by", "text")],
                [[n, doc, _PRINTED_BY[n]] for n, doc in SCHEMA_NAMES.items()],
            )
        return
    # one write per line: the output sink escapes line breaks inside a write (forged lines)
    with writing_stdout():
        for line in json.dumps(load_schema(name.value), indent=2).splitlines():
            sys.stdout.write(line + "\n")
        sys.stdout.flush()


EPILOG = examples(
    "ckpttool schema",
    "ckpttool schema inspect > inspect.schema.json",
    "ckpttool schema replay-step",
)
