"""A torchtitan training job estimated as torchtitan configures it: its train-config TOML, read.

    job = read_job("llama3_8b.toml", world=8)      # the job's model, batch, precision, degrees, AC
    est = estimate_job("llama3_8b.toml", world=8)  # memfit.estimate of that job's largest rank
    memfit estimate --torchtitan llama3_8b.toml --world 8

What is read (torchtitan's job config; both its 2024 layout and its later one):

- [model] name and flavor: torchtitan's Llama 3 flavors (llama3: debugmodel, 8B, 70B, 405B) as memfit
  Llama specs, the FFN width from torchtitan's rule (2/3 of 4 x dim, times ffn_dim_multiplier,
  rounded up to multiple_of) and the vocabulary of the tokenizer each flavor trains with.
- [training] local_batch_size (or batch_size), seq_len, mixed_precision_param/_reduce; [optimizer] name.
- [parallelism] (or [training] and [experimental]) data_parallel_shard_degree (-1: what the other
  degrees leave of the world), data_parallel_replicate_degree, tensor_parallel_degree,
  pipeline_parallel_degree, context_parallel_degree.
- [activation_checkpoint] mode (none, full, selective) and selective_ac_option ("op": torchtitan's op
  list, memfit's `selective:torchtitan`; an integer N: every N-th block recomputed whole, as torchtitan
  counts them, blocks N-1, 2N-1, ... from 0).

How memfit runs it: FSDP (shard degree > 1) is ZeRO-3 over the shard group (each rank holds 1/shard of
the model states; replicas add no memory), with bf16 compute weights gathered per block and fp32
sharded weights, gradients and Adam state: memfit's bf16-master, whose bf16 shard FSDP2 does not
keep (the fp32 shard is cast into the all-gather buffer), so the figures drop it: params are the fp32
shard, optimizer the Adam state. Without FSDP torchtitan trains in fp32 under bf16 autocast
(bf16-mixed). Tensor parallelism is memfit's tensor strategy with sequence and vocabulary parallelism
(torchtitan shards the norms over the sequence, and the embedding, head and loss over the
vocabulary); `local_batch_size` is the TP group's rows; with FSDP as well, the TP rank's model states
sharded by FSDP (an approximation, see _fsdp_over_tp). Pipeline parallelism, CP with tensor
parallelism, float8 linears and torch.compile are not modelled: the first two are refused, the last
two named in the estimate's note.
Context parallelism (with FSDP over shard x cp, torchtitan's weight sharding then) is each rank's
seq/cp tokens of every sequence: torch's ring attention keeps the local queries' outputs and
log-sum-exps, the ring's key/value chunks in flight are not counted.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from memfit.core.errors import ConfigError

# flavor -> (dim, layers, heads, kv_heads, ffn_dim_multiplier, multiple_of, vocab): torchtitan's
# torchtitan/models/llama3 ModelArgs; vocab: Llama 3's tokenizer (128,000 + 256 special tokens), the
# debug model's test tokenizer (2,000 + 256).
FLAVORS: dict[str, tuple] = {
    "debugmodel": (256, 8, 16, 16, None, 256, 2256),
    "8B": (4096, 32, 32, 8, 1.3, 1024, 128256),
    "70B": (8192, 80, 64, 8, 1.3, 4096, 128256),
    "405B": (16384, 126, 128, 8, 1.2, 4096, 128256),
}
MODELS = ("llama3",)
DTYPES = ("bfloat16", "float32")
_OPTIMIZERS = {"adamw": "adamw", "adam": "adam"}


@dataclass
class TorchtitanJob:
    path: str
    flavor: str
    batch: int
    """local_batch_size: rows per data-parallel rank (a TP group's rows)."""
    seq: int
    param_dtype: str
    reduce_dtype: str
    optimizer: str
    shard: int
    replicate: int
    tp: int
    pp: int
    cp: int
    ac_mode: str
    ac_option: str
    float8: bool = False
    compile: bool = False

    @property
    def world(self) -> int:
        return self.shard * self.replicate * self.tp * self.pp * self.cp


def ffn_width(dim: int, multiplier: float | None, multiple_of: int) -> int:
    """torchtitan's FeedForward hidden width for a block of width `dim`."""
    hidden = int(2 * 4 * dim / 3)
    if multiplier is not None:
        hidden = int(multiplier * hidden)
    return multiple_of * math.ceil(hidden / multiple_of)


def _load(path: str) -> dict:
    import tomllib

    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"--torchtitan {path}: no such file; give torchtitan's train-config TOML") from None
    except OSError as exc:
        raise ConfigError(f"--torchtitan {path}: cannot read it ({exc.strerror or exc}); give torchtitan's "
                          "train-config TOML file") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--torchtitan {path} is not valid TOML ({exc}); give torchtitan's train-config "
                          "file (e.g. torchtitan/models/llama3/train_configs/llama3_8b.toml)") from None


def _table(path: str, cfg: dict, name: str) -> dict:
    """The TOML table [name] (empty when absent)."""
    table = cfg.get(name, {})
    if not isinstance(table, dict):
        raise ConfigError(f"--torchtitan {path}: {name} must be a table ([{name}]), got {table!r}")
    return table


def _int(path: str, key: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"--torchtitan {path}: {key} = {value!r} must be an integer >= {low}")
    return value


def _degrees(path: str, cfg: dict, world: int) -> dict[str, int]:
    par, train, exp = (_table(path, cfg, k) for k in ("parallelism", "training", "experimental"))

    def get(key: str, low: int = 1) -> int:
        value = par.get(key, train.get(key, exp.get(key, 1)))
        return _int(path, key, value, low)

    out = {"replicate": get("data_parallel_replicate_degree"), "tp": get("tensor_parallel_degree"),
           "pp": get("pipeline_parallel_degree"), "cp": get("context_parallel_degree")}
    shard = get("data_parallel_shard_degree", low=-1)
    rest = math.prod(out.values())
    if shard == 0:
        raise ConfigError(f"--torchtitan {path}: data_parallel_shard_degree = 0; use -1 (the rest) or >= 1")
    if shard == -1:
        if world % rest:
            raise ConfigError(f"--torchtitan {path}: the other degrees ({rest} ranks) do not divide --world "
                              f"{world}; give a --world they divide")
        shard = world // rest
    out["shard"] = shard
    if shard * rest != world:
        raise ConfigError(f"--torchtitan {path}: its degrees make {shard * rest} ranks (shard {shard} x replicate "
                          f"{out['replicate']} x tp {out['tp']} x pp {out['pp']} x cp {out['cp']}), not --world "
                          f"{world}; give --world {shard * rest}")
    return out


def _checkpoint(path: str, cfg: dict) -> tuple[str, str]:
    ac = _table(path, cfg, "activation_checkpoint")
    mode = str(ac.get("mode", "selective"))
    option = str(ac.get("selective_ac_option", "2"))
    if mode not in ("none", "full", "selective"):
        raise ConfigError(f"--torchtitan {path}: activation_checkpoint mode = {mode!r}; torchtitan's modes: "
                          "none, full, selective")
    if mode == "selective" and option != "op" and not option.isdigit():
        raise ConfigError(f"--torchtitan {path}: selective_ac_option = {option!r}; use 'op' or an integer N "
                          "(every N-th block)")
    return mode, option


def read_job(path: str, world: int = 1) -> TorchtitanJob:
    """The job's settings (see the module docstring); ConfigError for anything memfit cannot read."""
    cfg = _load(path)
    model, train = _table(path, cfg, "model"), _table(path, cfg, "training")
    name, flavor = model.get("name", "llama3"), str(model.get("flavor", ""))
    if name not in MODELS or flavor not in FLAVORS:
        raise ConfigError(f"--torchtitan {path}: model {name!r} flavor {flavor!r} is not one memfit maps; "
                          f"accepted: {', '.join(MODELS)} with flavor {', '.join(FLAVORS)}")
    batch = _int(path, "local_batch_size", train.get("local_batch_size", train.get("batch_size", 8)), 1)
    seq = _int(path, "seq_len", train.get("seq_len", 2048), 1)
    dtypes = [str(train.get(k, d)) for k, d in (("mixed_precision_param", "bfloat16"),
                                                  ("mixed_precision_reduce", "float32"))]
    for key, value in zip(("mixed_precision_param", "mixed_precision_reduce"), dtypes):
        if value not in DTYPES:
            raise ConfigError(f"--torchtitan {path}: {key} = {value!r}; accepted: {', '.join(DTYPES)}")
    opt = str(_table(path, cfg, "optimizer").get("name", "AdamW")).lower()
    if opt not in _OPTIMIZERS:
        raise ConfigError(f"--torchtitan {path}: optimizer {opt!r} is not one memfit maps; accepted: AdamW, Adam")
    mode, option = _checkpoint(path, cfg)
    converters = model.get("converters", [])
    converters = converters if isinstance(converters, list) else [converters]
    float8 = bool(_table(path, cfg, "float8").get("enable_float8_linear", False)) or any("float8" in str(c)
                                                                                         for c in converters)
    compiled = bool(train.get("compile", False)) or bool(_table(path, cfg, "compile").get("enable", False))
    return TorchtitanJob(path, flavor, batch, seq, dtypes[0], dtypes[1], _OPTIMIZERS[opt],
                         ac_mode=mode, ac_option=option, float8=float8, compile=compiled,
                         **_degrees(path, cfg, world))


TABLE = {"8B": "llama-3.1-8b", "70B": "llama-3.1-70b", "405B": "llama-3.1-405b"}
"""Flavors with an entry in memfit's table of published shapes (memfit.models.spec.ARCHITECTURES)."""


def spec_string(job: TorchtitanJob) -> str:
    """The memfit model of the job's flavor: its table name, else a llama: spec of torchtitan's shape."""
    if job.flavor in TABLE:
        return TABLE[job.flavor]
    dim, layers, heads, kv, mult, multiple, vocab = FLAVORS[job.flavor]
    return (f"llama:layers={layers},hidden={dim},heads={heads},kv_heads={kv},ffn={ffn_width(dim, mult, multiple)},"
            f"vocab={vocab},seq={job.seq},rope_theta=500000")


def checkpoint_policy(job: TorchtitanJob, layers: int) -> str:
    """memfit's policy string for the job's activation checkpointing."""
    if job.ac_mode in ("none", "full"):
        return job.ac_mode
    if job.ac_option == "op":
        return "selective:torchtitan"
    n = int(job.ac_option)  # torchtitan: block i (from 1) recomputed when i % n == 0; n = 0: every block
    return ",".join("recompute" if n == 0 or (i + 1) % n == 0 else "keep" for i in range(layers))


def layout(job: TorchtitanJob, path: str) -> dict[str, Any]:
    """memfit.estimate's strategy arguments for the job's degrees."""
    if job.pp > 1:
        raise ConfigError(f"--torchtitan {path}: pipeline_parallel_degree {job.pp}: memfit estimates torchtitan's "
                          "FSDP, HSDP, DDP, CP and TP jobs, not PP")
    if job.tp > 1 and job.cp > 1:
        raise ConfigError(f"--torchtitan {path}: TP {job.tp} with CP {job.cp} is not estimated; memfit estimates "
                          "FSDP (or HSDP) with CP or with TP")
    fsdp = job.shard * job.cp > 1  # torchtitan shards the weights over the shard and CP dimensions together
    precision = "32-true" if job.param_dtype == "float32" else ("bf16-master" if fsdp else "bf16-mixed")
    if job.cp > 1:
        if job.seq % (2 * job.cp):  # torchtitan's load-balanced causal split: 2 x cp chunks per sequence
            raise ConfigError(f"--torchtitan {path}: seq_len {job.seq} does not split into 2 x {job.cp} chunks "
                              "for context parallelism; use a multiple of 2 x context_parallel_degree")
        return dict(strategy="zero3", world=job.shard * job.cp, batch=job.batch, seq=job.seq // job.cp,
                    precision=precision)
    if job.tp > 1:
        if job.batch % job.tp:
            raise ConfigError(f"--torchtitan {path}: local_batch_size {job.batch} does not split over TP {job.tp} "
                              "as memfit's per-process --batch; use a multiple of the TP degree")
        return dict(strategy="tensor", world=job.world, tp=job.tp, batch=job.batch // job.tp,
                    sequence_parallel=True, vocab_parallel=True, precision=precision)
    if fsdp:
        return dict(strategy="zero3", world=job.shard, batch=job.batch, precision=precision)
    if job.replicate > 1:
        return dict(strategy="ddp", world=job.replicate, batch=job.batch, precision=precision)
    return dict(batch=job.batch, precision=precision)


def describe(job: TorchtitanJob, lay: dict) -> str:
    """One line on what was read and how memfit runs it (printed before the estimate)."""
    degrees = ", ".join(f"{k} {getattr(job, k)}" for k in ("shard", "replicate", "tp", "pp", "cp")
                        if getattr(job, k) > 1) or "one device"
    ac = job.ac_mode + (f" ({job.ac_option})" if job.ac_mode == "selective" else "")
    text = (f"torchtitan job {job.path}: llama3 {job.flavor}, local batch {job.batch} x seq {job.seq}, "
            f"{degrees}, params {job.param_dtype} / reduce {job.reduce_dtype}, AC {ac}; memfit: "
            f"{lay.get('strategy', 'one device')} on {lay.get('world', 1)} ranks, {lay['precision']}"
            + (f", {lay.get('seq', job.seq)} tokens of each sequence per rank" if job.cp > 1 else ""))
    skipped = [name for name, on in (("float8 linears", job.float8), ("torch.compile", job.compile)) if on]
    if skipped:
        text += f"; not modelled: {' and '.join(skipped)} (they change the step's memory)"
    return text


def estimate_job(path: str, world: int = 1, **kw: Any):
    """memfit.estimate of the job's largest rank; `kw` (e.g. device=, device_memory=) passed through.
    The Estimate's `note` says what was read (describe())."""
    from memfit.measure.estimate import estimate
    from memfit.models.spec import parse_model

    job = read_job(path, world)
    spec = parse_model(spec_string(job))
    lay = layout(job, path)
    lay.setdefault("seq", job.seq)
    est = estimate(spec, optimizer=job.optimizer, checkpoint=checkpoint_policy(job, spec.config.layers), **lay, **kw)
    if lay.get("strategy") == "zero3" and lay["precision"] == "bf16-master":
        from memfit.measure.fsdp2_estimate import fsdp2_states

        fsdp2_states(est)
    if lay.get("strategy") == "tensor" and job.shard > 1:
        _fsdp_over_tp(est, spec, job)
    if getattr(est, "reserve_overhead", None) is not None and est.device is not None:
        est.per_device["reserved"] = est.per_device["total"] + est.reserve_overhead  # the GPU's reserve, again
    est.model = f"torchtitan llama3 {job.flavor}"
    est.note = describe(job, lay)
    return est


def _fsdp_over_tp(est: Any, spec: Any, job: TorchtitanJob) -> None:
    """FSDP over the shard group of each TP rank's model (torchtitan's 2-D layout), from the TP rank's
    figures: its weights, gradients and Adam state divided by the shard degree as FSDP2 keeps them (fp32
    shards: params twice the bf16 bytes), plus the bf16 weights FSDP gathers (the embedding, final norm
    and head, and two blocks: the running one and the prefetched one). An approximation: the TP
    rank's peak moment is kept as traced with whole model states."""
    import torch

    from memfit.measure.parallel_estimate import local_tp_gpt
    from memfit.measure.rank_estimate import per_device

    with torch.device("meta"):
        local = local_tp_gpt(spec, job.seq, job.tp, vocab_parallel=True)
    block = 2 * sum(p.numel() for p in local.blocks[0].parameters())  # bf16 bytes of one TP-local block
    whole = 2 * sum(p.numel() for p in local.parameters())
    for row in est.ranks:
        bf16, n = row["params"], job.shard
        row["optimizer"] = (row["optimizer"] - 2 * bf16) // n  # Adam's state; the fp32 master becomes params
        row["params"] = 2 * bf16 // n
        row["grads"] = 2 * row["grads"] // n
        row["gathered"] = whole - spec.config.layers * block + 2 * block
        row["total"] = sum(row[c] for c in ("params", "gathered", "grads", "in_flight", "optimizer", "activations",
                                            "temporaries"))
        row["fsdp"] = n
    est.ranks.sort(key=lambda r: (-r["total"], r["rank_ids"][0]))
    est.per_device = per_device(est.ranks[0])
