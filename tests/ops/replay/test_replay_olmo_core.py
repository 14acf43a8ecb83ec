"""`replay-step` and `validate --deep` on two saves of OLMo-core's own optimizer and LR schedule
(``tests/fixtures/olmo_core_writer.py``, :func:`build_olmo_core_steps`), against the next save read with OLMo-core's
own reader (``olmo_core.distributed.checkpoint.load_keys``).

OLMo-core's train module sets each param group's ``lr`` from its scheduler right before the optimizer step, so the
saved ``lr`` is the saved step's: the trainer's next step takes the schedule's next one.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from ckpttool.cli.app import app
from ckpttool.ops.replay import ReplayOptions, replay_step
from tests.fixtures.cache import cached_build

pytestmark = pytest.mark.slow  # OLMo-core's trainer checkpointer on a gloo rank

runner = CliRunner()


@pytest.fixture(scope="module")
def olmo_steps(fixture_root: Path) -> Path:
    from tests.fixtures import olmo_core_writer
    from tests.fixtures.writers import missing

    why = missing("olmo_core.train.checkpoint", "olmo_core.optim")
    if why:
        pytest.skip(why)
    return cached_build(fixture_root, "olmo_core_steps", olmo_core_writer.build_olmo_core_steps)


def test_replay_of_a_scheduled_lr_says_the_trainers_next_step_takes_another(olmo_steps: Path) -> None:
    """During the warmup replay-step said OK with no word about the lr: it stepped with the saved lr (the lr of step
    1, which OLMo-core set before that step), while the trainer's step 2 took the schedule's lr at step 2, so the
    replayed weights are not the ones the trainer saved next. It now says so; the moments and step are the
    trainer's, bitwise. validate --strict --deep is silent on both clean saves."""
    from olmo_core.distributed.checkpoint import load_keys
    from olmo_core.optim import CosWithWarmup

    from tests.fixtures.olmo_core_writer import STEPS_LR, STEPS_MAX, STEPS_WARMUP

    run = olmo_steps / "run"
    for step in ("step1", "step2"):
        res = runner.invoke(app, ["validate", str(run / step), "--strict", "--deep", "--json"])
        doc = json.loads(res.stdout)
        assert res.exit_code == 0 and doc["counts"]["error"] == doc["counts"]["warning"] == 0, doc["findings"]
    got: dict[str, dict[str, torch.Tensor]] = {}
    res = replay_step(
        run / "step1",
        ReplayOptions(device="cpu", grads=olmo_steps / "grads2.safetensors"),
        on_param=lambda f, t: got.setdefault(f, {k: v.clone() for k, v in t.items()}),
    )
    assert res.ok and len(res.params) == 21
    lr1 = CosWithWarmup(warmup=STEPS_WARMUP).get_lr(STEPS_LR, 1, STEPS_MAX)
    lr2 = CosWithWarmup(warmup=STEPS_WARMUP).get_lr(STEPS_LR, 2, STEPS_MAX)
    assert lr1 != lr2 and all(p.lr == pytest.approx(lr1) for p in res.params)
    (note,) = [n for n in res.notes if "the lr of the saved step" in n]
    assert (
        note.startswith("warning: ") and "OLMo-core's train module" in note and "not the ones the trainer saves" in note
    )
    fqn = "blocks.0.attention.w_q.weight"
    keys = [f"model.{fqn}", *(f"optim.state.{fqn}.{f}" for f in ("exp_avg", "exp_avg_sq", "step"))]
    param, exp_avg, exp_avg_sq, step = load_keys(run / "step2" / "model_and_optim", keys)
    mine = got[fqn]
    assert mine["exp_avg"].equal(exp_avg) and mine["exp_avg_sq"].equal(exp_avg_sq) and mine["step"].equal(step)
    assert not mine["param"].equal(param)  # stepped with lr1: the trainer's step 2 took lr2
