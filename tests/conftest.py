"""Session-cached real DCP fixtures (built once, shared by xdist workers).

Fixture checkpoints are read-only by convention: a test that damages one works on
``copy_checkpoint(fixture, tmp_path / "x")``.
"""

from __future__ import annotations

import os
import signal
import warnings
from pathlib import Path

import pytest

from tests.fixtures import builders
from tests.fixtures.cache import cached_build

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

# A background job of a non-interactive shell starts with SIGINT ignored, and a child inherits an ignored
# signal across exec: the tests that press Ctrl-C on a child (exit 130, nothing left behind) would then
# see it run to the end. A handler is reset to the default at exec, so the children get Ctrl-C again.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session")
def fixture_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    env = os.environ.get("CKPTTOOL_FIXTURE_CACHE")
    if env:
        return Path(env)
    # Shared across xdist workers: the parent of the per-worker base temp.
    base = tmp_path_factory.getbasetemp()
    root = base.parent if base.name.startswith("popen-gw") else base
    return root / "ckpttool-fixtures"


@pytest.fixture(scope="session")
def dense_ckpt(fixture_root: Path) -> Path:
    """Fixture (a): dense BF16 LM + AdamW, nested flavor, persistent buffer."""
    return cached_build(fixture_root, "dense", builders.build_dense)


@pytest.fixture(scope="session")
def multi_optim_ckpt(fixture_root: Path) -> Path:
    """Fixture (b): flattened multi-optimizer, never-stepped leaf with LR 0.0025."""
    return cached_build(fixture_root, "multi_optim", builders.build_multi_optim)


@pytest.fixture(scope="session")
def fsdp_ckpt(fixture_root: Path) -> Path:
    """Fixture (c): 4-rank FSDP2 save with uneven and zero-size chunks."""
    return cached_build(fixture_root, "fsdp", builders.build_fsdp)


@pytest.fixture(scope="session")
def sample_ckpt(fixture_root: Path) -> Path:
    """The `ckpttool sample` checkpoint."""
    from ckpttool.ops.sample import write_sample

    return cached_build(fixture_root, "sample", write_sample)


@pytest.fixture(scope="session")
def ep_suite(fixture_root: Path) -> Path:
    """Every 4-rank EP DTensor save of :data:`tests.fixtures.moe_ep.VARIANTS` (read-only: copy before damaging)."""
    from tests.fixtures.moe_ep import build_ep_suite

    return cached_build(fixture_root, "moe_ep", build_ep_suite)


@pytest.fixture(scope="session")
def ep_uneven_legacy(fixture_root: Path) -> Path:
    """Legacy saves of 6 ranks whose experts do not split evenly (:data:`tests.fixtures.moe_ep.UNEVEN`)."""
    from tests.fixtures.moe_ep import build_uneven_legacy

    return cached_build(fixture_root, "moe_ep_uneven_legacy", build_uneven_legacy)


@pytest.fixture(scope="session")
def per_expert_ckpt(fixture_root: Path) -> Path:
    """Per-expert MoE keys where EP rank 0 saved only its local experts 0..3 (of 8) under local names."""
    return cached_build(fixture_root, "validate_per_expert", builders.build_per_expert)


# ------------------------------------------------------------------ third-party writers (tests/fixtures/writers.py)
def _writer(fixture_root: Path, name: str, build: str, *modules: str) -> Path:
    from tests.fixtures import writers

    why = writers.missing(*modules)
    if why:
        pytest.skip(why)
    return cached_build(fixture_root, name, getattr(writers, build))


@pytest.fixture(scope="session")
def titan_root(fixture_root: Path) -> Path:
    """torchtitan CheckpointManager saves: llama3/, llama3_hf/, llama3_fresh/, moe/ (each .../checkpoint/step-N)."""
    return _writer(fixture_root, "writers_torchtitan", "build_torchtitan", "torchtitan.components.checkpoint", "triton")


@pytest.fixture(scope="session")
def acc_root(fixture_root: Path) -> Path:
    """Accelerate pairs (accelerate/checkpoint-{0,1}), app_state/, hf_sharded/, hf_consolidated/, moe_fsdp2/."""
    return _writer(
        fixture_root, "writers_accelerate", "build_accelerate", "accelerate.utils.fsdp_utils", "transformers"
    )


@pytest.fixture(scope="session")
def acc_state_root(fixture_root: Path) -> Path:
    """Accelerator.save_state (FSDP2) run: checkpoints/checkpoint_{0,1} (after steps 2 and 4) and expected.pt."""
    return _writer(
        fixture_root, "writers_accelerate_state", "build_accelerate_save_state", "accelerate", "transformers"
    )


@pytest.fixture(scope="session")
def hf_shards_root(fixture_root: Path) -> Path:
    """w2/, w3/: HuggingFaceStorageWriter(save_distributed=True) DTensor saves on 2 and 3 ranks (tests/fixtures/hf_shards.py)."""
    from tests.fixtures import hf_shards, writers

    why = writers.missing("transformers")
    if why:
        pytest.skip(why)
    return cached_build(fixture_root, "hf_shards", hf_shards.build_hf_shards)


@pytest.fixture(scope="session")
def moe4_root(fixture_root: Path) -> Path:
    """moe_fsdp4/: a transformers Qwen3-MoE under plain FSDP2 on 4 ranks."""
    return _writer(fixture_root, "writers_moe4", "build_moe4", "transformers")


@pytest.fixture(scope="session")
def plain_root(fixture_root: Path) -> Path:
    """plain_optimizer/ (optimizer.state_dict(), index-keyed) and flat_hf/ (dcp.save(model.state_dict()))."""
    return _writer(fixture_root, "writers_plain", "build_plain", "transformers")


@pytest.fixture(scope="session")
def ep_multichunk_ckpt(fixture_root: Path) -> Path:
    """EP 2 via torch ShardedTensor: every EP rank saved its experts as 2 chunks (tests/fixtures/writers.py)."""
    from tests.fixtures import writers

    return cached_build(fixture_root, "writers_ep_multichunk", writers.build_ep_multichunk)


# ------------------------------------------------------------------ object storage (tests/fixtures/s3.py)
@pytest.fixture(scope="session")
def s3_server():  # type: ignore[no-untyped-def]
    """A moto S3 server on 127.0.0.1 (one per xdist worker); skipped without ``ckpttool[s3]`` + ``moto[server]``."""
    from tests.fixtures import s3

    why = s3.missing()
    if why:
        pytest.skip(why)
    server = s3.S3Server().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session", autouse=True)
def _metadata_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The parsed-``.metadata`` cache of this session (never the user's ``~/.cache/ckpttool``); inherited by subprocesses."""
    path = tmp_path_factory.mktemp("metadata-cache")
    os.environ["CKPTTOOL_CACHE_DIR"] = str(path)
    return path
