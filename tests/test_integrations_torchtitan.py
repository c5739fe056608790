"""torchtitan jobs: the train-config TOML read as torchtitan sets the job up, its op-list selective
checkpointing carried onto memfit's block (same gradients, the bytes it keeps), and the CLI."""
import json

import pytest
import torch

import memfit
from memfit.cli import main
from memfit.integrations.torchtitan import checkpoint_policy, estimate_job, ffn_width, read_job, spec_string

DEBUG = """
[model]
name = "llama3"
flavor = "debugmodel"
[training]
local_batch_size = 2
seq_len = 64
[parallelism]
data_parallel_shard_degree = -1
[activation_checkpoint]
mode = "selective"
selective_ac_option = "op"
"""


def write(tmp_path, text, name="job.toml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_flavors_get_torchtitans_ffn_widths():
    # torchtitan's rule: int(2/3 x 4 dim) x multiplier, rounded up to multiple_of (Llama 3.1's published widths)
    assert ffn_width(4096, 1.3, 1024) == 14336
    assert ffn_width(8192, 1.3, 4096) == 28672
    assert ffn_width(16384, 1.2, 4096) == 53248
    assert ffn_width(256, None, 256) == 768


def test_both_config_layouts_give_the_same_job(tmp_path):
    old = """
[model]
name = "llama3"
flavor = "8B"
[training]
batch_size = 2
seq_len = 8192
data_parallel_shard_degree = -1
data_parallel_replicate_degree = 2
tensor_parallel_degree = 1
[experimental]
pipeline_parallel_degree = 1
context_parallel_degree = 1
[activation_checkpoint]
mode = 'selective'
selective_ac_option = 'op'
"""
    new = old.replace("batch_size", "local_batch_size").replace(
        "data_parallel_shard_degree = -1\ndata_parallel_replicate_degree = 2\ntensor_parallel_degree = 1\n", "")
    new += "[parallelism]\ndata_parallel_shard_degree = -1\ndata_parallel_replicate_degree = 2\n"
    a, b = read_job(write(tmp_path, old, "old.toml"), 16), read_job(write(tmp_path, new, "new.toml"), 16)
    for job in (a, b):
        assert (job.batch, job.seq, job.shard, job.replicate, job.tp) == (2, 8192, 8, 2, 1)
        assert (job.param_dtype, job.reduce_dtype, job.optimizer) == ("bfloat16", "float32", "adamw")
    assert spec_string(a) == "llama-3.1-8b"


def test_flavors_are_the_published_shapes():
    # memfit's table entries of the torchtitan flavors have torchtitan's shapes (its ModelArgs and FFN rule)
    from memfit.integrations.torchtitan import FLAVORS, TABLE
    from memfit.models.spec import parse_model

    for flavor, name in TABLE.items():
        dim, layers, heads, kv, mult, multiple, vocab = FLAVORS[flavor]
        cfg = parse_model(name).config
        assert (cfg.hidden, cfg.layers, cfg.heads, cfg.kv_heads, cfg.vocab) == (dim, layers, heads, kv, vocab)
        assert cfg.ffn == ffn_width(dim, mult, multiple) and cfg.rope_theta == 500000.0


def test_checkpoint_options_map_to_memfit_policies(tmp_path):
    job = read_job(write(tmp_path, DEBUG), 2)
    assert checkpoint_policy(job, 8) == "selective:torchtitan"
    job.ac_option = "2"  # torchtitan counts blocks from 1 and recomputes the multiples of N
    assert checkpoint_policy(job, 4) == "keep,recompute,keep,recompute"
    job.ac_mode = "full"
    assert checkpoint_policy(job, 4) == "full"


def test_estimate_is_memfits_estimate_of_the_mapped_run(tmp_path):
    est = estimate_job(write(tmp_path, DEBUG), 2)
    ref = memfit.estimate(spec_string(read_job(write(tmp_path, DEBUG), 2)), batch=2, seq=64, precision="bf16-master",
                          strategy="zero3", world=2, checkpoint="selective:torchtitan")
    # FSDP2 keeps the fp32 shard and no bf16 one: params are the fp32 shard, optimizer Adam's two states
    bf16, (row,) = ref.ranks[0]["params"], est.ranks
    assert row["params"] == 2 * bf16 and row["optimizer"] == ref.ranks[0]["optimizer"] - 2 * bf16
    assert est.total == ref.total - bf16 and est.strategy == "zero3"
    assert row["activations"] == ref.ranks[0]["activations"] and row["temporaries"] == ref.ranks[0]["temporaries"]
    assert "shard 2" in est.note and "bf16-master" in est.note


@pytest.mark.parametrize("text, message", [
    ("bad = [", "not valid TOML"),
    (DEBUG.replace('"debugmodel"', '"9B"'), "flavor"),
    (DEBUG.replace("data_parallel_shard_degree = -1", "data_parallel_shard_degree = 4"), "give --world 4"),
    (DEBUG.replace("[parallelism]\n", "[parallelism]\npipeline_parallel_degree = 2\n"), "not PP"),
    (DEBUG.replace("[parallelism]\n", "[parallelism]\ncontext_parallel_degree = 2\n").replace("64", "66"),
     "2 x 2 chunks"),
    (DEBUG.replace('"op"', '"sometimes"'), "selective_ac_option"),
    (DEBUG.replace("seq_len = 64", "seq_len = 0"), "seq_len"),
])
def test_bad_jobs_end_in_one_line(tmp_path, capsys, text, message):
    assert main(["estimate", "--torchtitan", write(tmp_path, text), "--world", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_context_parallel_runs_each_ranks_share_of_the_sequence(tmp_path):
    text = DEBUG.replace("[parallelism]\n", "[parallelism]\ncontext_parallel_degree = 2\n")
    est = estimate_job(write(tmp_path, text), 4)  # FSDP over shard 2 x cp 2: the weights on 4 ranks
    assert (est.strategy, est.world, est.seq) == ("zero3", 4, 32) and "32 tokens of each sequence" in est.note


TP_JOB = DEBUG.replace("[parallelism]\n", "[parallelism]\ntensor_parallel_degree = 2\n")


@pytest.mark.slow  # the default tier reads and estimates a torchtitan job in the tests above
def test_tensor_parallel_jobs_shard_the_sequence_and_vocabulary(tmp_path):
    est = estimate_job(write(tmp_path, TP_JOB.replace("= -1", "= 1")), 2)
    (row,) = est.ranks
    assert (est.strategy, est.precision, row["tp"], row["rows"]) == ("tensor", "bf16-mixed", 2, 2)
    assert row["sequence_parallel"] and row["vocab_parallel"]


@pytest.mark.slow  # three traces of the 8-block debug model (about 8 s of CPU)
def test_fsdp_over_tensor_parallel_shards_each_tp_ranks_states(tmp_path):
    tp_only = estimate_job(write(tmp_path, TP_JOB.replace("= -1", "= 1"), "tp.toml"), 2)
    both = estimate_job(write(tmp_path, TP_JOB, "both.toml"), 4)  # FSDP 2 x TP 2
    (row,), (fsdp,) = tp_only.ranks, both.ranks
    # FSDP2 over the TP rank's model: its states sharded over 2 ranks, the gathered weights added
    assert fsdp["fsdp"] == 2 and 0 < fsdp["gathered"] and both.total < tp_only.total
    # Adam's state (fp32 either way) halved; the bf16-master fp32 master moved to params
    assert fsdp["optimizer"] == row["optimizer"] // 2
    assert fsdp["activations"] == pytest.approx(row["activations"], rel=0.05)  # bf16-master vs bf16-mixed autocast


def test_cli_prints_the_job_and_the_ranks(tmp_path, capsys):
    path = write(tmp_path, DEBUG)
    assert main(["estimate", "--torchtitan", path, "--world", "2"]) == 0
    out = capsys.readouterr().out
    assert "llama3 debugmodel, local batch 2 x seq 64, shard 2" in out and "zero3 on 2 ranks" in out
    assert main(["estimate", "--torchtitan", path, "--world", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["strategy"] == "zero3" and data["world"] == 2 and data["checkpoint"] == "selective:torchtitan"
    assert main(["estimate", "gpt2", "--torchtitan", path]) == 2


def _tiny(dropout=0.1):
    from memfit.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(layers=2, hidden=32, heads=4, kv_heads=2, ffn=48, vocab=64, seq=16, dropout=dropout,
                         arch="llama"))


def _grads(policy):
    model = _tiny()
    memfit.checkpoint(model, policy)
    torch.manual_seed(1)
    x = torch.randint(0, 64, (2, 16))
    _, loss, _ = model(x, x)
    loss.backward()
    return loss.item(), {k: p.grad.clone() for k, p in model.named_parameters()}


def test_torchtitan_op_list_gives_the_plain_gradients():
    loss, grads = _grads("none")
    loss2, grads2 = _grads("selective:torchtitan")
    assert loss == loss2 and all(torch.equal(grads[k], grads2[k]) for k in grads)


def test_torchtitan_op_list_keeps_its_bytes_and_less_than_none():
    from memfit.measure.trace import measure_step, trace_step
    from memfit.models.spec import parse_model

    h, kv, ffn, heads, tokens = 64, 32, 160, 4, 2 * 64
    spec = parse_model(f"llama:layers=2,hidden={h},heads={heads},kv_heads=2,ffn={ffn},vocab=128,seq=64")
    traced = trace_step(spec, 2, 64, "32-true", "sgd", "selective:torchtitan")
    measured = measure_step(spec, 2, 64, "32-true", "sgd", "selective:torchtitan", allocator=False)
    assert traced.peak == measured.peak
    # per token, fp32: the block input, the fused qkv output, the attention output and its logsumexp (one
    # per head), the SwiGLU product (w1's width) and the MLP's output projection
    assert traced.module_activations["blocks.0"] == tokens * 4 * (h + (h + 2 * kv) + h + heads + ffn + h)
    plain = measure_step(spec, 2, 64, "32-true", "sgd", "none", allocator=False)
    assert measured.peak < plain.peak


def test_the_op_list_policy_parses_in_every_form():
    from memfit.apply.policy import BlockAction, resolve_policy, to_json, to_string
    from memfit.core.errors import ConfigError

    tt = BlockAction("selective", ops="torchtitan")
    assert resolve_policy("selective:torchtitan", 2) == [tt, tt]
    assert resolve_policy("keep,selective:torchtitan*2", 3) == [BlockAction("keep"), tt, tt]
    assert resolve_policy(to_json([tt, BlockAction("keep")]), 2) == [tt, BlockAction("keep")]
    assert to_string([tt, tt]) == "selective:torchtitan*2"
    for bad in ("recompute:torchtitan", "selective:megatron"):
        with pytest.raises(ConfigError, match="selective:torchtitan"):
            resolve_policy(bad, 2)
