"""Hugging Face families beyond causal LMs (seq2seq, masked LM, image classification): built from a
config.json by `architectures` or --task, each estimate within 3% of the allocator on a real step."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

import memfit
from memfit.cli import main
from memfit.core.errors import ConfigError
from memfit.measure.anymodel_estimate import measure_module
from memfit.models.spec import parse_model

transformers = pytest.importorskip("transformers")

CONFIGS = {
    "t5": lambda: transformers.T5Config(vocab_size=512, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
                                        decoder_start_token_id=0, architectures=["T5ForConditionalGeneration"]),
    "bart": lambda: transformers.BartConfig(vocab_size=512, d_model=64, encoder_layers=2, decoder_layers=2,
                                            encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                                            decoder_ffn_dim=128, max_position_embeddings=128,
                                            architectures=["BartForConditionalGeneration"]),
    "bert": lambda: transformers.BertConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                            intermediate_size=128, max_position_embeddings=128,
                                            architectures=["BertForMaskedLM"]),
    "vit": lambda: transformers.ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                          intermediate_size=128, image_size=32, patch_size=8, num_labels=10,
                                          architectures=["ViTForImageClassification"]),
}
TASK = {"t5": "seq2seq", "bart": "seq2seq", "bert": "masked-lm", "vit": "image-classification"}


def write(tmp_path, name: str, drop_architectures: bool = False) -> str:
    data = CONFIGS[name]().to_dict()
    if drop_architectures:
        data.pop("architectures")
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(data))
    return str(path)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_family_estimate_within_3pct_of_the_allocator(tmp_path, name):
    path = write(tmp_path, name)
    spec = parse_model(path, families=True)
    assert spec.task == TASK[name]
    est = memfit.estimate(path, batch=4, seq=64)
    real = measure_module(lambda: spec.build(seq=64), spec.example(4, 64))
    assert abs(est.total - real["allocator"]) <= 0.03 * real["allocator"], (est.total, real)
    assert est.per_device["activations"] > 0 and est.modules


def test_task_from_config_without_architectures_and_image_size(tmp_path):
    assert parse_model(write(tmp_path, "t5", drop_architectures=True), families=True).task == "seq2seq"
    assert parse_model(write(tmp_path, "bert", drop_architectures=True), task="masked-lm").task == "masked-lm"
    vit = write(tmp_path, "vit")
    small = memfit.estimate(vit, batch=2).per_device["activations"]
    large = memfit.estimate(parse_model(vit, image_size=64), batch=2).per_device["activations"]
    assert large > 3 * small  # 4x the patches


@pytest.mark.parametrize("argv,needle", [
    (["bert", "--task", "causal-lm"], "--task causal-lm does not match"),
    (["bert", "--task", "image-classification"], "use --task masked-lm"),
    (["t5", "--image-size", "64"], "--image-size applies to image models"),
    (["gpt2", "--task", "seq2seq"], "applies to a Hugging Face config.json"),
    (["vit", "--task", "seq2seq"], "does not match"),
])
def test_bad_task_one_line_exit_2(tmp_path, capsys, argv, needle):
    model = argv[0] if argv[0] == "gpt2" else write(tmp_path, argv[0])
    assert main(["estimate", model, *argv[1:]]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and needle in err[0], err


def test_cli_family_json(tmp_path, capsys):
    assert main(["estimate", write(tmp_path, "vit"), "--batch", "2", "--image-size", "64", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["seq"] is None and "image-classification" in data["model"] and data["per_device"]["total"] > 0


def test_track_and_train_still_take_causal_lms_only(tmp_path):
    with pytest.raises(ConfigError, match="encoder-decoder"):
        parse_model(write(tmp_path, "t5"))


def test_estimate_leaves_later_models_initialised(tmp_path):
    """transformers copies torch's init functions into a table on first import; an estimate that
    triggers that import while init is switched off must not leave the table empty-handed."""
    path = write(tmp_path, "bert")
    code = ("import torch, transformers, memfit\n"
            f"memfit.estimate({path!r}, batch=2, seq=16)\n"
            "import transformers.initialization as ti\n"
            "assert all(f is getattr(torch.nn.init, n) for n, f in ti.TORCH_INIT_FUNCTIONS.items()), 'no-op init kept'\n"
            f"m = transformers.AutoModelForMaskedLM.from_config(transformers.AutoConfig.from_pretrained({path!r}))\n"
            "assert all(torch.isfinite(p).all() for p in m.parameters()) and m.bert.embeddings.word_embeddings.weight.std() > 0\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
