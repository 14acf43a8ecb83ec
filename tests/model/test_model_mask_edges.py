"""``KeySchema.model_mask``, ``_fqns_of`` and ``_unjoined`` against their per-key definitions on odd keys.

Random keys built from hostile pieces (empty components, the prefix itself, ``"."``, int path
items, planner paths that join to their key in several ways or not at all), every model prefix
shape a user can give (``""``, ``"."``, ``".."``, one without its trailing dot) and optimizer
prefixes that do and do not overlap the model prefix.
"""

from __future__ import annotations

import random
from typing import Any

from ckpttool.model.catalog import _fqns_of
from ckpttool.model.schemas.detect import _unjoined
from ckpttool.model.schemas.keyschema import KeySchema

_ATOMS = ("model", "", "optimizer", "state", "x", "model.", ".", "0", "optim", "a.b")
_PREFIXES = ("", "model.", "model.model.", ".", "model", "x.", "..", "optimizer.")
_OPTIMIZER_PREFIXES = (None, "", "optimizer.", "model.optimizer.", "model.", "model.model.x")


def _key(rnd: random.Random) -> str:
    return ".".join(rnd.choice(_ATOMS) for _ in range(rnd.randint(0, 4)))


def _path(rnd: random.Random, key: str) -> tuple[Any, ...]:
    r = rnd.random()
    if r < 0.3:
        return tuple(key.split("."))
    if r < 0.5:
        return tuple(key.split(".", 1))
    if r < 0.6:
        return tuple(int(p) if p.isdigit() else p for p in key.split("."))
    if r < 0.7:
        return ()
    if r < 0.8:
        return (key,)
    return tuple(rnd.choice(_ATOMS) for _ in range(rnd.randint(0, 3)))


def test_mask_fqns_and_join_match_the_per_key_definitions() -> None:
    rnd = random.Random(1)
    for _ in range(400):
        keys = list(dict.fromkeys(_key(rnd) for _ in range(rnd.randint(0, 12))))
        paths = {k: _path(rnd, k) for k in keys if rnd.random() < 0.7}
        unjoined = [k for k, p in paths.items() if ".".join(map(str, p)) != k]  # planner_paths' definition
        assert _unjoined(paths) == unjoined
        joined = {k: p for k, p in paths.items() if k not in unjoined}
        for prefix in _PREFIXES:
            head = tuple(prefix[:-1].split(".")) if prefix.endswith(".") else ()
            for op in _OPTIMIZER_PREFIXES:
                for use_paths in (True, False):
                    s = KeySchema("custom", prefix, op, _model_head=head, _use_paths=use_paths)
                    test = s.model_test()
                    want = [test(k, joined.get(k)) for k in keys]
                    assert list(s.model_mask(dict.fromkeys(keys), joined)) == want, (prefix, op, keys, joined)
                    model = [k for k, w in zip(keys, want) if w]
                    assert _fqns_of(dict.fromkeys(model), prefix, joined) == [s.fqn_of(k) for k in model]
                    assert _fqns_of(dict.fromkeys(keys), prefix, joined) == [s.fqn_of(k) for k in keys]


def test_fqns_from_planner_paths_only_when_every_last_item_is_a_str() -> None:
    # every key has a path of the prefix's components plus one item, but one item is an int (a list index)
    paths: dict[str, tuple[Any, ...]] = {
        "model.0": ("model", 0),
        "model.a": ("model", "a"),
        "model.b.c": ("model", "b.c"),
    }
    s = KeySchema("custom", "model.", None, _model_head=("model",))
    assert _unjoined(paths) == []
    assert _fqns_of(dict.fromkeys(paths), "model.", paths) == ["0", "a", "b.c"]
    assert all(type(f) is str for f in _fqns_of(dict.fromkeys(paths), "model.", paths))
    assert list(s.model_mask(dict.fromkeys([*paths, "model.", "model"]), paths)) == [True, True, True, False, False]
