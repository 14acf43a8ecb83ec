"""Merged LoRA export (`--merge-lora` / `--format hf-merged`) against PEFT's own `merge_and_unload()`."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from tests.fixtures import hf_models
from tests.ops.export.test_export import assert_clean_failure, export_cli, read_export
from tests.ops.export.test_export_consumers import (  # noqa: F401  (session fixtures)
    assert_same_logits,
    export,
    load_hf,
    lora_ckpt,
)


def _peft_merged(lora_ckpt: Path, tmp_path: Path) -> torch.nn.Module:  # noqa: F811
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    export(lora_ckpt, tmp_path / "adapter", "--format", "lora", "--lora-alpha", str(hf_models.LORA_ALPHA))
    base = load_hf(lora_ckpt / "base", LlamaForCausalLM)
    return PeftModel.from_pretrained(base, tmp_path / "adapter").merge_and_unload()


@pytest.mark.parametrize("flag", [("--merge-lora",), ("--format", "hf-merged")])
def test_merged_export_matches_peft_merge_and_unload(lora_ckpt: Path, tmp_path: Path, flag: tuple[str, ...]) -> None:  # noqa: F811
    from transformers import LlamaForCausalLM

    doc = export(lora_ckpt, tmp_path / "merged", *flag, "--lora-alpha", str(hf_models.LORA_ALPHA))
    assert doc["format"] == "hf-merged" and doc["model_check"]["findings"] == {}
    got, _ = read_export(tmp_path / "merged")
    ref = _peft_merged(lora_ckpt, tmp_path)
    want = ref.state_dict()
    assert set(got) == set(want)
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=1e-6)  # FP32 merge; BLAS summation order may differ
    ids = torch.load(lora_ckpt / "reference.pt", weights_only=True)["ids"]
    model = load_hf(tmp_path / "merged", LlamaForCausalLM)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=0, atol=1e-5)
    assert_same_logits(model, lora_ckpt)  # and the unmerged PEFT model's logits


def test_merged_bf16_output_is_written_in_the_requested_dtype(lora_ckpt: Path, tmp_path: Path) -> None:  # noqa: F811
    export(lora_ckpt, tmp_path / "m", "--merge-lora", "--lora-alpha", "8", "--save-dtype", "bf16")
    got, _ = read_export(tmp_path / "m")
    assert {t.dtype for t in got.values()} == {torch.bfloat16}


def test_merge_without_alpha_is_refused(lora_ckpt: Path, tmp_path: Path) -> None:  # noqa: F811
    res = export_cli(str(lora_ckpt), str(tmp_path / "o"), "--merge-lora")
    assert_clean_failure(res, "E601", "lora_alpha is unknown")


def test_merge_lora_with_format_lora_is_refused_not_merged(lora_ckpt: Path, tmp_path: Path) -> None:  # noqa: F811
    """`--merge-lora --format lora` asks for the adapter and for the merged model at once: --merge-lora silently won
    (a merged model where the adapter was asked for). It is E100 naming both, nothing written; each alone works."""
    out = tmp_path / "o"
    for args in (["--merge-lora", "--format", "lora"], ["--format", "lora", "--merge-lora", "--dry-run"]):
        res = export_cli(str(lora_ckpt), str(out), *args, "--lora-alpha", str(hf_models.LORA_ALPHA))
        assert_clean_failure(res, "E100", "--merge-lora (= --format hf-merged) and --format lora are exclusive")
        assert not out.exists()
    for args in (["--merge-lora"], ["--format", "lora"]):
        res = export_cli(str(lora_ckpt), str(out), *args, "--lora-alpha", str(hf_models.LORA_ALPHA), "--dry-run")
        assert res.exit_code == 0, res.stderr


def test_dora_is_refused_by_name(lora_ckpt: Path, tmp_path: Path) -> None:  # noqa: F811
    cfg = {
        "peft_type": "LORA",
        "r": hf_models.LORA_R,
        "lora_alpha": 8,
        "target_modules": ["q_proj", "v_proj"],
        "use_dora": True,
    }
    (tmp_path / "adapter_config.json").write_text(json.dumps(cfg))
    res = export_cli(
        str(lora_ckpt), str(tmp_path / "o"), "--merge-lora", "--adapter-config", str(tmp_path / "adapter_config.json")
    )
    assert_clean_failure(res, "E601", "DoRA")


def test_an_rslora_merge_scales_as_peft_does(tmp_path: Path) -> None:
    """LoraConfig(use_rslora=True) scales the delta by alpha / sqrt(r), not alpha / r. Before, every rsLoRA merge
    was refused (E601 "the rsLoRA ... merge is not implemented"); now, with the run's adapter config (its
    rank_pattern and alpha_pattern too), the merged weights equal `merge_and_unload()`'s and give the trained logits."""
    from peft import LoraConfig, PeftModel
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    from tests.ops.export.test_export_lora_inputs import _trained_peft

    lcfg = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj", "down_proj"],
        use_rslora=True,
        rank_pattern={"v_proj": 2},
        alpha_pattern={"down_proj": 32},
        task_type="CAUSAL_LM",
    )
    ids, want = _trained_peft(tmp_path, 16, lcfg)
    given = str(tmp_path / "peft" / "adapter_config.json")
    res = export_cli(
        str(tmp_path / "ckpt"),
        str(tmp_path / "m"),
        "--format",
        "hf-merged",
        "--adapter-config",
        given,
        "--model-assets",
        str(tmp_path / "base"),
    )
    assert res.exit_code == 0, res.stderr
    ref = PeftModel.from_pretrained(load_hf(tmp_path / "base", LlamaForCausalLM), tmp_path / "peft")
    ref_sd = ref.merge_and_unload().state_dict()
    got = load_file(tmp_path / "m" / "model.safetensors")
    for k in ("q_proj", "v_proj"):
        key = f"model.layers.0.self_attn.{k}.weight"
        torch.testing.assert_close(got[key], ref_sd[key], rtol=0, atol=1e-6)
    key = "model.layers.1.mlp.down_proj.weight"
    torch.testing.assert_close(got[key], ref_sd[key], rtol=0, atol=1e-6)
    merged = load_hf(tmp_path / "m", LlamaForCausalLM).eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, want, rtol=0, atol=1e-5)


def test_merge_that_changes_nothing_is_refused(lora_ckpt: Path, tmp_path: Path) -> None:  # noqa: F811
    res = export_cli(
        str(lora_ckpt), str(tmp_path / "o"), "--merge-lora", "--lora-alpha", "1e-30", "--save-dtype", "bf16"
    )
    assert_clean_failure(res, "E601", "bitwise equal to the base weights")
    assert not (tmp_path / "o").exists()


def test_plain_hf_export_of_a_peft_checkpoint_is_refused(lora_ckpt: Path, tmp_path: Path) -> None:  # noqa: F811
    res = export_cli(str(lora_ckpt), str(tmp_path / "o"))
    assert_clean_failure(res, "E601", "PEFT LoRA checkpoint", "base_layer")


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_a_merge_beyond_float16s_range_is_refused_naming_the_value(
    lora_ckpt: Path,  # noqa: F811
    tmp_path: Path,
    dtype: str,
) -> None:
    """The base weight fits float16; W + s * B @ A does not: E601 naming the tensor, the merged value and its
    index, as the plain cast does, and no output (a stored float16 checkpoint, and float32 with --save-dtype float16)."""
    import torch.distributed.checkpoint as dcp

    md = dcp.FileSystemReader(str(lora_ckpt)).read_metadata()
    sd = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in md.state_dict_metadata.items()}
    dcp.load(sd, checkpoint_id=str(lora_ckpt), no_dist=True)
    b = next(k for k in sd if ".q_proj.lora_B." in k and ".layers.0." in k)
    sd[b] = torch.zeros_like(sd[b])
    sd[b][3, :] = 3000.0  # row 3 of B @ A: 3000 * 3 * r; scale alpha / r
    sd[b.replace("lora_B", "lora_A")] = torch.full_like(sd[b.replace("lora_B", "lora_A")], 3.0)
    src = tmp_path / "src"
    dcp.save(
        {"model": {k[len("model.") :]: v.to(getattr(torch, dtype)) for k, v in sd.items()}}, checkpoint_id=str(src)
    )
    out = tmp_path / "merged"
    res = export_cli(str(src), str(out), "--merge-lora", "--lora-alpha", "16", "--save-dtype", "float16")
    assert_clean_failure(res, "E601", "q_proj.base_layer.weight: finite float32 value(s) beyond float16's range")
    value = (
        float(sd[b.replace("lora_B.default", "base_layer")][3, 0]) + 16 / hf_models.LORA_R * 3000 * 3 * hf_models.LORA_R
    )
    assert res.stderr.splitlines()[-2].endswith(f"e.g. {value:.6g} at [3, 0]"), res.stderr
    assert not out.exists()


def test_filtered_merge_reports_unmerged_factors_as_filtered(lora_ckpt: Path, tmp_path: Path) -> None:  # noqa: F811
    """--filter on layer 0: layer 1's LoRA factors were merged into nothing; they are listed as excluded by the
    filter, not as 'merged into its base weight'."""
    res = export_cli(
        str(lora_ckpt), str(tmp_path / "o"), "--merge-lora", "--lora-alpha", str(hf_models.LORA_ALPHA),
        "--filter", "*layers.0.*", "--json",
    )  # fmt: skip
    assert res.exit_code == 0, res.stderr
    skipped = json.loads(res.stdout)["skipped"]
    merged = skipped["LoRA factor merged into its base weight"]["keys"]
    assert merged and all(".layers.0." in k for k in merged)
    assert any(".layers.1." in k and ".lora_A." in k for k in skipped["excluded by `filter_glob`"]["keys"])


def test_a_gpt2_conv1d_lora_exports_and_merges_as_peft_does(tmp_path: Path) -> None:
    """GPT-2's attention and MLP are Conv1D (weights stored [in, out]); PEFT adapts them with fan_in_fan_out (set by
    the module's type) and merges the delta transposed. Before, `--format lora` refused PEFT's own adapter (E601
    "do not form a LoRA pair ... of its base weight [32, 96]") and so did the merge, which refused fan_in_fan_out by
    name. Now the adapter holds PEFT's keys and bytes and loads with the trained logits; the merge equals
    `merge_and_unload()`'s weights, the square attn.c_proj (which the shapes cannot tell from a Linear) included,
    told by config.json's model class or the adapter config; with neither, it is refused (E601), not guessed."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from safetensors.torch import load_file
    from transformers import GPT2Config, GPT2LMHeadModel

    hf_models._quiet()
    torch.manual_seed(21)
    cfg = GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0)
    GPT2LMHeadModel(cfg).save_pretrained(tmp_path / "base")
    lcfg = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_proj"], fan_in_fan_out=True)
    model = get_peft_model(load_hf(tmp_path / "base", GPT2LMHeadModel), lcfg)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(21))
    want = hf_models.train_peft(model, ids, ids, tmp_path)
    ck, given = str(tmp_path / "ckpt"), str(tmp_path / "peft" / "adapter_config.json")

    res = export_cli(ck, str(tmp_path / "o"), "--format", "lora", "--adapter-config", given)
    assert res.exit_code == 0, res.stderr
    ours, peft = (
        load_file(tmp_path / "o" / "adapter_model.safetensors"),
        load_file(tmp_path / "peft" / "adapter_model.safetensors"),
    )
    assert sorted(ours) == sorted(peft) and all(torch.equal(ours[k], peft[k]) for k in peft)
    loaded = PeftModel.from_pretrained(load_hf(tmp_path / "base", GPT2LMHeadModel), tmp_path / "o").eval()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, want)

    ref = PeftModel.from_pretrained(load_hf(tmp_path / "base", GPT2LMHeadModel), tmp_path / "peft").merge_and_unload()
    ref_sd = ref.state_dict()
    for name, args in [
        ("m1", ("--model-assets", str(tmp_path / "base"), "--lora-alpha", "8")),
        ("m2", ("--adapter-config", given)),
    ]:
        res = export_cli(ck, str(tmp_path / name), "--format", "hf-merged", *args)
        assert res.exit_code == 0, res.stderr
        got = load_file(tmp_path / name / "model.safetensors")
        for k in (
            "transformer.h.0.attn.c_attn.weight",
            "transformer.h.0.attn.c_proj.weight",
            "transformer.h.1.mlp.c_proj.weight",
        ):
            torch.testing.assert_close(got[k], ref_sd[k], rtol=0, atol=1e-6)
            assert not torch.equal(got[k], load_file(tmp_path / "base" / "model.safetensors")[k])
    merged = load_hf(tmp_path / "m1", GPT2LMHeadModel).eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, want, rtol=0, atol=1e-5)
    res = export_cli(ck, str(tmp_path / "m3"), "--format", "hf-merged", "--lora-alpha", "8")
    assert_clean_failure(res, "E601", "attn.c_proj.base_layer.weight", "cannot be told")
    assert not (tmp_path / "m3").exists()


def test_a_sequence_classifier_merges_as_peft_does(tmp_path: Path) -> None:
    """A LoRA classifier (LlamaForSequenceClassification, task_type SEQ_CLS: PEFT trains the `score` head in full as a
    modules_to_save copy). Before, `hf-merged` with the base model's config.json (architectures
    LlamaForSequenceClassification) was refused E605 "does not fit LlamaForCausalLM ... missing lm_head.weight |
    unexpected score.weight": the model check always built the causal LM. Now it builds the class the config names
    and the merged model's logits equal `merge_and_unload()`'s, the trained score head included."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import LlamaForSequenceClassification

    hf_models._quiet()
    torch.manual_seed(22)
    cfg = hf_models.llama_config()
    cfg.pad_token_id, cfg.num_labels = 0, 3
    LlamaForSequenceClassification(cfg).save_pretrained(tmp_path / "base")
    lcfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="SEQ_CLS")
    model = get_peft_model(load_hf(tmp_path / "base", LlamaForSequenceClassification), lcfg)
    ids = torch.randint(1, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(22))
    want = hf_models.train_peft(model, ids, torch.tensor([0, 2]), tmp_path)

    res = export_cli(
        str(tmp_path / "ckpt"),
        str(tmp_path / "m"),
        "--format",
        "hf-merged",
        "--model-assets",
        str(tmp_path / "base"),
        "--adapter-config",
        str(tmp_path / "peft" / "adapter_config.json"),
    )
    assert res.exit_code == 0, res.stderr
    base = load_hf(tmp_path / "base", LlamaForSequenceClassification)
    ref = PeftModel.from_pretrained(base, tmp_path / "peft").merge_and_unload().eval()
    merged = load_hf(tmp_path / "m", LlamaForSequenceClassification).eval()
    with torch.no_grad():
        got = merged(ids).logits
        torch.testing.assert_close(got, ref(ids).logits, rtol=0, atol=1e-6)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("tied", [False, True])
def test_lora_on_the_embedding_merges_as_peft_does(tmp_path: Path, tied: bool) -> None:
    """LoRA on `embed_tokens` (PEFT's Embedding: lora_embedding_A [r, vocab], lora_embedding_B [dim, r], delta
    (B @ A).T). Before, every such merge was refused (E601 "LoRA on an embedding; its merge is not implemented").
    Now the merged embedding equals `merge_and_unload()`'s and the merged model gives the trained logits; with tied
    embeddings (the merged embedding would be the head too, the trained head is the unmerged one) it is E601."""
    from peft import LoraConfig, PeftModel
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    from tests.ops.export.test_export_lora_inputs import _trained_peft

    lcfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "embed_tokens"], task_type="CAUSAL_LM")
    ids, want = _trained_peft(tmp_path, 17, lcfg, tied=tied)
    given = str(tmp_path / "peft" / "adapter_config.json")
    args = ("--format", "hf-merged", "--adapter-config", given, "--model-assets", str(tmp_path / "base"))
    res = export_cli(str(tmp_path / "ckpt"), str(tmp_path / "m"), *args)
    if tied:
        assert_clean_failure(res, "E601", "embed_tokens", "tie_word_embeddings: true")
        assert not (tmp_path / "m").exists()
        return
    assert res.exit_code == 0, res.stderr
    ref = PeftModel.from_pretrained(load_hf(tmp_path / "base", LlamaForCausalLM), tmp_path / "peft")
    key = "model.embed_tokens.weight"
    got = load_file(tmp_path / "m" / "model.safetensors")[key]
    torch.testing.assert_close(got, ref.merge_and_unload().state_dict()[key], rtol=0, atol=1e-6)
    assert not torch.equal(got, load_file(tmp_path / "base" / "model.safetensors")[key])
    merged = load_hf(tmp_path / "m", LlamaForCausalLM).eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, want, rtol=0, atol=1e-5)
    # no config.json and no adapter config: the square q_proj beside the embedding is merged as a Linear
    res = export_cli(str(tmp_path / "ckpt"), str(tmp_path / "m2"), "--format", "hf-merged", "--lora-alpha", "8")
    assert res.exit_code == 0, res.stderr
    assert torch.equal(load_file(tmp_path / "m2" / "model.safetensors")[key], got)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(
        load_file(tmp_path / "m2" / "model.safetensors")[q], load_file(tmp_path / "m" / "model.safetensors")[q]
    )


@pytest.mark.parametrize("variant", ["alora", "kasa"])
def test_lora_variants_that_merge_to_another_model_are_refused(tmp_path: Path, variant: str) -> None:
    """aLoRA (alora_invocation_tokens: the adapter acts only from the invocation tokens on; PEFT's merge raises) and
    KaSA (kasa_config: B @ A scaled by a trained lora_diag, the base weight truncated) keep PEFT's lora_A / lora_B
    names. Before, `hf-merged` with the run's adapter config wrote W + s * B @ A and exited 0 (KaSA without config.json
    also wrote its lora_diag tensors as model keys); now each is E601 naming the variant, and no output is written."""
    from peft import LoraConfig, PeftModel
    from transformers import LlamaForCausalLM

    from tests.ops.export.test_export_lora_inputs import _trained_peft

    extra: dict[str, object] = {"alora_invocation_tokens": [3, 4]}
    if variant == "kasa":
        from peft.tuners.lora.config import KasaConfig

        extra = {"kasa_config": KasaConfig()}
    lcfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM", **extra)
    _trained_peft(tmp_path, 18, lcfg)
    if variant == "alora":  # the reference: PEFT itself does not merge it
        ref = PeftModel.from_pretrained(load_hf(tmp_path / "base", LlamaForCausalLM), tmp_path / "peft")
        with pytest.raises(NotImplementedError, match="aLoRA"):
            ref.merge_and_unload()
    given = str(tmp_path / "peft" / "adapter_config.json")
    res = export_cli(str(tmp_path / "ckpt"), str(tmp_path / "m"), "--format", "hf-merged", "--adapter-config", given)
    assert_clean_failure(res, "E601", next(iter(extra)))
    assert not (tmp_path / "m").exists()
    if variant == "kasa":  # no adapter config: its lora_diag tensors tell
        res = export_cli(str(tmp_path / "ckpt"), str(tmp_path / "m2"), "--format", "hf-merged", "--lora-alpha", "8")
        assert_clean_failure(res, "E601", "lora_diag")
        assert not (tmp_path / "m2").exists()


def test_a_velora_run_merges_as_peft_does(tmp_path: Path) -> None:
    """VeloRA (LoraConfig velora_config) trains plain LoRA factors beside a `lora_velora_embed.<adapter>` projection
    of its own, which PEFT's merge leaves out. Before, `hf-merged` with config.json was refused E605 ("unexpected
    ...q_proj.lora_velora_embed.default"), and without config.json wrote those tensors as model keys; now they are
    skipped as the variant's training state and the merged weights equal `merge_and_unload()`'s."""
    from peft import LoraConfig, PeftModel
    from peft.tuners.lora.config import VeloraConfig
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    from tests.ops.export.test_export_lora_inputs import _trained_peft

    lcfg = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM", velora_config=VeloraConfig()
    )
    ids, want = _trained_peft(tmp_path, 19, lcfg)
    given = str(tmp_path / "peft" / "adapter_config.json")
    ref = PeftModel.from_pretrained(load_hf(tmp_path / "base", LlamaForCausalLM), tmp_path / "peft")
    ref_sd = ref.merge_and_unload().state_dict()
    for name, args in [("m", ("--model-assets", str(tmp_path / "base"))), ("m2", ())]:
        res = export_cli(
            str(tmp_path / "ckpt"), str(tmp_path / name), "--format", "hf-merged", "--adapter-config", given, *args
        )
        assert res.exit_code == 0, res.stderr
        got = load_file(tmp_path / name / "model.safetensors")
        assert sorted(got) == sorted(ref_sd)
        for k in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.v_proj.weight"):
            torch.testing.assert_close(got[k], ref_sd[k], rtol=0, atol=1e-6)
    merged = load_hf(tmp_path / "m", LlamaForCausalLM).eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, want, rtol=0, atol=1e-5)


def test_a_square_conv1d_lora_merged_without_config_is_warned_about(tmp_path: Path) -> None:
    """GPT-2 LoRA on attn.c_proj only: every adapted weight is a square Conv1D ([in, out]), so no shape tells it from
    an nn.Linear. Before, `hf-merged --lora-alpha` alone merged it as a Linear (delta not transposed: weights far from
    `merge_and_unload()`'s) and exited 0 with no word of it; now it says so and names what tells, and with
    `--model-assets` the merged weight equals PEFT's, with no such warning."""
    import torch.distributed.checkpoint as dcp
    from peft import LoraConfig, PeftModel, get_peft_model
    from safetensors.torch import load_file
    from transformers import GPT2Config, GPT2LMHeadModel

    hf_models._quiet()
    torch.manual_seed(23)
    cfg = GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0)
    GPT2LMHeadModel(cfg).save_pretrained(tmp_path / "base")
    lcfg = LoraConfig(r=4, lora_alpha=8, target_modules=["attn.c_proj"], init_lora_weights=False)
    model = get_peft_model(load_hf(tmp_path / "base", GPT2LMHeadModel), lcfg)
    dcp.save({"model": dict(model.state_dict())}, checkpoint_id=str(tmp_path / "ckpt"))
    model.save_pretrained(tmp_path / "peft")
    ref = PeftModel.from_pretrained(load_hf(tmp_path / "base", GPT2LMHeadModel), tmp_path / "peft").merge_and_unload()
    key = "transformer.h.0.attn.c_proj.weight"

    res = export_cli(str(tmp_path / "ckpt"), str(tmp_path / "m"), "--format", "hf-merged", "--lora-alpha", "8")
    assert res.exit_code == 0, res.stderr
    assert "merged as nn.Linear" in res.stderr and "--model-assets" in res.stderr, res.stderr
    args = ("--format", "hf-merged", "--lora-alpha", "8", "--model-assets", str(tmp_path / "base"))
    res = export_cli(str(tmp_path / "ckpt"), str(tmp_path / "m2"), *args)
    assert res.exit_code == 0, res.stderr
    assert "merged as nn.Linear" not in res.stderr
    got = load_file(tmp_path / "m2" / "model.safetensors")[key]
    torch.testing.assert_close(got, ref.state_dict()[key], rtol=0, atol=1e-6)


def test_a_merge_that_rounds_to_a_bfloat16_infinity_is_refused_naming_the_value(
    lora_ckpt: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    """W + s * B @ A finite in float32 (3.398e38) but beyond bfloat16's largest (3.39e38), ``--save-dtype bfloat16``:
    E601 from the cast itself (the message and hint of every float32 -> bfloat16 overflow, as float16's range in the
    test above), naming the tensor, the merged value and its index; no output."""
    import torch.distributed.checkpoint as dcp

    md = dcp.FileSystemReader(str(lora_ckpt)).read_metadata()
    sd = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in md.state_dict_metadata.items()}
    dcp.load(sd, checkpoint_id=str(lora_ckpt), no_dist=True)
    b = next(k for k in sd if ".q_proj.lora_B." in k and ".layers.0." in k)
    sd[b] = torch.zeros_like(sd[b])
    sd[b][3, :] = 3.398e38 / 16  # row 3 of B @ A: x * r; scale alpha / r = 16 / r
    sd[b.replace("lora_B", "lora_A")] = torch.ones_like(sd[b.replace("lora_B", "lora_A")])
    src = tmp_path / "src"
    dcp.save({"model": {k[len("model.") :]: v.float() for k, v in sd.items()}}, checkpoint_id=str(src))
    out = tmp_path / "merged"
    res = export_cli(str(src), str(out), "--merge-lora", "--lora-alpha", "16", "--save-dtype", "bfloat16")
    assert_clean_failure(res, "E601", "q_proj.base_layer.weight: finite float32 value(s) beyond bfloat16's range")
    assert re.search(r"e\.g\. 3\.39\d+e\+38 at \[3, 0\]$", res.stderr.splitlines()[-2]), res.stderr
    assert not out.exists()
