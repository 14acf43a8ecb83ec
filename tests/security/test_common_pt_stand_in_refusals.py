"""A Megatron-LM ``common.pt`` whose ``args`` rebuild an allowed class the wrong way (an enum from ``None``, an
``argparse.Namespace`` from a state that is not a dict, a path from an int, an enum from a 2000-bit int).

The stand-ins (:func:`~ckpttool.format.unpickler.enum_stand_in`, :class:`~ckpttool.format.unpickler.AttributeBag`,
:data:`~ckpttool.format.unpickler.path_stand_in`) refuse it, but the refusal named no file: ``inspect``/``stats`` said
``[E201] enum ModelType rebuilt from None`` and ``validate`` blamed ``.metadata``. The refusal also sent the bytes on
to ``torch.load``, as if they only needed torch's weights-only unpickler. Now it is one line naming ``common.pt``,
with or without tensors in the file.
"""

from __future__ import annotations

import argparse
import io
import pickle
import shutil
import signal
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from ckpttool.cli.app import app
from ckpttool.errors import UnsafePickleError
from ckpttool.format.reader import load_saved_object
from ckpttool.model.schemas.megatron import _common_globals
from tests.fixtures.hostile import Call
from tests.security.test_pickle_build_globals import _common_pt, _global

DENSE1 = Path(__file__).parent.parent / "fixtures" / "megatron_data" / "dense1" / "iter_0000003"


def _key(text: str) -> bytes:
    return b"X" + len(text).to_bytes(4, "little") + text.encode()


#: ``{"args": <the bad rebuild>}``: what each stand-in is handed, and the words of its refusal
BAD_ARGS = {
    "enum from None": (_global("megatron.core.enums", "ModelType") + b")R", "enum ModelType rebuilt from None"),
    "namespace state a tuple": (_global("argparse", "Namespace") + b")\x81N}\x86b", "state that is not a dict"),
    "path from an int": (_global("pathlib", "PosixPath") + b"K\x01\x85R", "non-string parts"),
    # an enum's value is a small int: a 2000-bit one was taken and spelled out in a 600-digit name
    "enum from a 2000-bit int": (
        _global("signal", "Signals") + pickle.dumps(2**2000, 2)[2:-1] + b"\x85R",
        "enum Signals rebuilt from <int of 2001 bits>",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_ARGS))
@pytest.mark.parametrize("command", ["inspect", "validate", "stats"])
def test_a_stand_in_refusal_names_common_pt(tmp_path: Path, case: str, command: str) -> None:
    ck = tmp_path / "iter_0000003"
    shutil.copytree(DENSE1, ck)
    ops, words = BAD_ARGS[case]
    (ck / "common.pt").write_bytes(_common_pt(b"\x80\x02}" + _key("args") + ops + b"s."))
    before = (ck / "common.pt").read_bytes()
    res = CliRunner().invoke(app, [command, str(ck)])
    assert res.exit_code == 2, res.output
    assert res.exception is None or isinstance(res.exception, SystemExit)
    first = res.stderr.splitlines()[0]
    assert first.startswith("error: [E201]") and "common.pt" in first and words in first, res.stderr
    assert ".metadata" not in first
    assert (ck / "common.pt").read_bytes() == before


def test_a_stand_in_refusal_beside_tensors_names_the_file() -> None:
    """With tensors the file goes to ``torch.load(weights_only=True)``, which calls the same stand-in."""
    buf = io.BytesIO()
    torch.save({"t": torch.ones(2), "args": argparse.Namespace(sig=Call(signal.Signals, None))}, buf)
    with pytest.raises(UnsafePickleError) as e:
        load_saved_object(buf.getvalue(), "run/common.pt", plain_globals=_common_globals())
    assert e.value.path == "run/common.pt" and e.value.message.startswith(
        "run/common.pt: enum Signals rebuilt from None"
    )
    # the same file without the bad enum reads
    buf = io.BytesIO()
    torch.save({"t": torch.ones(2), "args": argparse.Namespace(sig=Call(signal.Signals, 2))}, buf)
    got = load_saved_object(buf.getvalue(), "run/common.pt", plain_globals=_common_globals())
    assert got["args"] == {"sig": "Signals(2)"}
