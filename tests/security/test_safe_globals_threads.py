"""Megatron-LM's ``common.pt`` holding tensors beside its ``args`` is loaded by ``torch.load(weights_only=True)``
with the ``args`` stand-ins registered through ``torch.serialization.safe_globals``, a process-wide set that torch's
context manager replaces on entry and exit. Two such loads at once (library users reading checkpoints in threads)
lost each other's stand-ins: a spurious ``E304`` for a file that reads alone. They now take turns, and torch's set is
what it was before.
"""

from __future__ import annotations

import argparse
import io
import pathlib
import threading

import torch

from ckpttool.format.reader import load_saved_object
from ckpttool.model.schemas.megatron import _common_globals


def test_common_pt_with_tensors_loads_in_threads_and_leaves_torchs_safe_globals() -> None:
    buf = io.BytesIO()
    args = argparse.Namespace(lr=0.1, save=pathlib.PosixPath("/runs/a"))
    torch.save({"iteration": 3, "t": torch.ones(2), "args": args}, buf)
    data = buf.getvalue()
    before = set(map(repr, torch.serialization.get_safe_globals()))
    got: list[object] = []

    def read() -> None:
        for _ in range(150):
            try:
                got.append(load_saved_object(data, "common.pt", plain_globals=_common_globals())["args"])
            except Exception as e:  # the failure is what the test counts
                got.append(e)

    threads = [threading.Thread(target=read) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [g for g in got if not isinstance(g, dict)] == []
    assert all(g == {"lr": 0.1, "save": "/runs/a"} for g in got)
    assert set(map(repr, torch.serialization.get_safe_globals())) == before


def test_the_args_stand_ins_are_built_where_the_real_classes_are_registered_too() -> None:
    """``import megatron.core`` registers real classes (``pathlib.PosixPath``, ``argparse.Namespace``) as torch safe
    globals for the whole process; a ``common.pt`` with tensors then still gives the inert stand-ins (a dict, a str),
    and the process's registrations are left as they were."""
    buf = io.BytesIO()
    torch.save({"t": torch.ones(2), "args": argparse.Namespace(save=pathlib.PosixPath("/runs/a"))}, buf)
    real = [pathlib.PosixPath, argparse.Namespace]
    with torch.serialization.safe_globals(real):
        before = set(torch.serialization.get_safe_globals())
        assert before >= set(real)
        for i in range(20):  # torch picks among same-named entries in set order, which more entries reshuffle
            with torch.serialization.safe_globals([(len, f"unused.name{j}") for j in range(i * 3)]):
                args = load_saved_object(buf.getvalue(), "common.pt", plain_globals=_common_globals())["args"]
            assert type(args) is not argparse.Namespace and args == {"save": "/runs/a"}
            assert type(args["save"]) is str
        assert set(torch.serialization.get_safe_globals()) == before
