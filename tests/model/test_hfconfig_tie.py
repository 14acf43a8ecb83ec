"""``tie_word_embeddings`` of a config.json that leaves it out: the default of transformers' own config class."""

from __future__ import annotations

from typing import Any

import pytest

from ckpttool.model.hfconfig import TIE_DEFAULTS, tie_word_embeddings

transformers = pytest.importorskip("transformers")
from transformers.models.auto.configuration_auto import CONFIG_MAPPING  # noqa: E402


def _without_tie(cfg: Any) -> dict[str, Any]:
    """``cfg.to_dict()`` with ``tie_word_embeddings`` removed (top level and ``text_config``), as older hub configs."""
    doc = cfg.to_dict()
    doc.pop("tie_word_embeddings", None)
    if isinstance(doc.get("text_config"), dict):
        doc["text_config"].pop("tie_word_embeddings", None)
    return doc


@pytest.mark.parametrize("model_type", sorted(TIE_DEFAULTS))
def test_table_is_transformers_class_default(model_type: str) -> None:
    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no {model_type}")
    cfg = CONFIG_MAPPING[model_type]()
    want = getattr(cfg, "tie_word_embeddings", None)
    if want is None:
        want = getattr(cfg.get_text_config(), "tie_word_embeddings", None)
    assert TIE_DEFAULTS[model_type] is want
    assert tie_word_embeddings(_without_tie(cfg)) is want


@pytest.mark.parametrize(
    ("model_type", "tied"),
    [
        ("gpt2", True),
        ("gemma", True),
        ("gemma2", True),
        ("llama", False),
        ("qwen2", False),
        ("qwen3", False),
        ("qwen3_moe", False),
        ("mistral", False),
        ("olmo2", False),
    ],
)
def test_absent_key_follows_the_model_type(model_type: str, tied: bool) -> None:
    doc = _without_tie(CONFIG_MAPPING[model_type]())
    assert "tie_word_embeddings" not in doc
    assert tie_word_embeddings(doc) is tied
    doc["tie_word_embeddings"] = not tied  # a value set always wins
    assert tie_word_embeddings(doc) is (not tied)


def test_unlisted_model_type_is_asked_of_transformers() -> None:
    mt = next(t for t in ("xglm", "ctrl", "openai-gpt", "biogpt") if t in CONFIG_MAPPING and t not in TIE_DEFAULTS)
    cfg = CONFIG_MAPPING[mt]()
    assert tie_word_embeddings(_without_tie(cfg)) is cfg.tie_word_embeddings


def test_no_model_type_or_unknown_is_not_decided() -> None:
    assert tie_word_embeddings({"vocab_size": 64}) is None
    assert tie_word_embeddings({"model_type": "no-such-model-type", "vocab_size": 64}) is None
    assert tie_word_embeddings(None) is None
