"""An output URL that names the source checkpoint's prefix under another scheme of the same store.

fsspec opens ``s3a://`` with the same ``S3FileSystem`` as ``s3://`` (Hadoop and Spark users write ``s3a``), so
``s3a://b/ck`` is the prefix ``s3://b/ck``. The output's overlap check compared the URLs only when their schemes
were one: ``export s3://b/ck s3a://b/ck/hf`` published the export inside the checkpoint's prefix, and
``export s3://b/ck s3a://b/ck --overwrite`` of a checkpoint ckpttool wrote (its marker agrees with its objects)
deleted the source's ``.metadata`` and data files and left the export in their place. Both are E600 before anything
is uploaded, as ``s3://`` on both sides and local directories are.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from ckpttool.cli.app import app
from ckpttool.format.storage import same_store, url_path

runner = CliRunner()


def test_an_s3a_output_inside_or_over_the_s3_source_is_refused(sample_ckpt: Path, s3_server: Any) -> None:
    assert (sample_ckpt / ".ckpttool-output.json").is_file()  # a ckpttool output: --overwrite may replace it
    url = s3_server.upload_dir(sample_ckpt, "ckpts", f"t-{uuid.uuid4().hex[:8]}")
    prefix = url.split("/", 3)[3] + "/"
    before = {
        k: s3_server.client().get_object(Bucket="ckpts", Key=k)["Body"].read() for k in s3_server.keys("ckpts", prefix)
    }
    alias = url.replace("s3://", "s3a://", 1)
    for args in ([f"{alias}/hf"], [alias, "--overwrite"], [f"{alias}/hf", "--dry-run"]):
        r = runner.invoke(app, [*s3_server.cli_options(), "export", url, *args])
        assert r.exit_code == 2, r.output
        assert "Traceback" not in r.stderr
        assert r.stderr.splitlines()[0] == f"error: [E600] {args[0]}: the output overlaps the source checkpoint {url}"
    after = {
        k: s3_server.client().get_object(Bucket="ckpts", Key=k)["Body"].read() for k in s3_server.keys("ckpts", prefix)
    }
    assert after == before


@pytest.mark.parametrize(
    ("a", "b", "same"),
    [
        ("s3://b/k", "s3a://b/k", True),
        ("gs://b/k", "gcs://b/k", True),
        ("az://c/k", "abfs://c/k", True),
        ("s3://b/k", "gs://b/k", False),
        ("memory://b/k", "s3://b/k", False),
        ("madeup://b/k", "othermadeup://b/k", False),
    ],
)
def test_same_store_follows_fsspecs_filesystem_of_each_scheme(a: str, b: str, same: bool) -> None:
    assert same_store(url_path(a), url_path(b)) is same
    assert same_store(url_path(b), url_path(a)) is same
