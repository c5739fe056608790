"""Compression specs: "topk:0.01", "int8", "sign", "bf16", "fp16", "powersgd:4", "none".

A spec is a name, an optional main value after ":" and optional ",key=value" options:

    topk:0.01                       top-k 1%, error feedback, bf16 values + int32 indices
    topk:0.001,momentum=0.9,warmup=200   DGC: momentum correction, ratio warm-up over 200 steps
    int8:chunk=512,stochastic       8-bit, absmax scale per 512 elements, stochastic rounding
    sign:chunk=1024                 1-bit sign, mean-|x| scale per chunk, error feedback
    powersgd:4                      torch's powerSGD_hook (per matrix), rank 4 (DDP only)
    powersgd:4,batched              memfit's batched PowerSGD (whole bucket as one square matrix)
    sign:adam=0                     1-bit Adam: each rank's local Adam direction sent 1-bit with
                                    error feedback, averaged into the update (onebit.py)
    topk:0.01,adam=5                the same with top-k 1%, after 5 int8 warm-up steps of plain Adam;
                                    top-k keeps the elements whose owed step buys the most loss
                                    decrease to first order (select=gain), the residual holds
                                    lr-scaled steps (owe=step)
    topk:0.01,adam=5,select=x       ... keeping the largest |direction + residual| instead
    sign:adam=5,var=batch           adam mode dividing by the batch's estimated second moment
    topk:0.01,adam=off              plain error feedback even under Adam(W) (see defaults.py)

Plain `topk:R` and `sign` pick their mode from the optimizer when registered (defaults.py): adam
mode (adam=5) under an Adam(W) that can carry it, plain error feedback otherwise (SGD).
"""
from __future__ import annotations

from dataclasses import dataclass

from memfit.core.errors import ConfigError

NAMES = ("none", "topk", "int8", "sign", "bf16", "fp16", "powersgd")
STRATEGIES_WITH_COMPRESSION = ("ddp", "zero1", "zero2")
_FLAGS = {"stochastic", "batched"}
_OPTIONS = {"ratio", "rank", "chunk", "momentum", "warmup", "ef", "values", "seed", "start", "adam", "warm", "clip",
            "var", "select", "owe"}
WARM_CODECS = ("int8", "fp32")
VARIANCES = ("batch", "rank")
SELECTIONS = ("agree", "gain", "x")
OWED = ("step", "direction")


@dataclass(frozen=True)
class CompressionSpec:
    name: str = "none"
    ratio: float = 0.01
    """top-k: fraction of elements sent, in (0, 1]."""
    rank: int = 4
    """PowerSGD: matrix approximation rank, >= 1."""
    chunk: int = 1024
    """int8 / sign: elements per scale."""
    stochastic: bool = False
    """int8: stochastic rounding (unbiased) instead of round-to-nearest."""
    momentum: float = 0.0
    """top-k, sign: momentum correction factor (0 = off): the momentum is kept before compression
    (DGC). Pair it with plain SGD (no momentum)."""
    warmup: int = 0
    """top-k: steps over which the ratio decays from 25% to `ratio` (DGC warm-up)."""
    ef: bool | None = None
    """Error feedback; None = the compressor's default (on for topk and sign, off otherwise)."""
    values: str = "bf16"
    """top-k: dtype of the sent values ("bf16" or "fp32"); bf16 rounding goes into the residual."""
    batched: bool = False
    """PowerSGD: memfit's batched variant instead of torch's per-matrix powerSGD_hook."""
    seed: int = 0
    start: int | None = None
    """Plain fp32 all-reduce for the first `start` steps (an uncompressed warm-up, as 1-bit Adam
    and PowerSGD use); None = 2 for PowerSGD (lets DDP rebuild its buckets), else 0."""
    adam: int | None = None
    """topk, sign: compressed Adam update. The first `adam` steps exchange the gradient through
    `warm` and the optimizer runs plain Adam(W); after them each rank sends its error-compensated
    local Adam direction and the mean is the update. Needs the optimizer: see onebit.py."""
    warm: str = "int8"
    """adam mode: the warm-up exchange, "int8" (4x fewer bytes than fp32) or "fp32"."""
    var: str | None = None
    """adam mode: the second moment in each rank's Adam direction. "rank": the rank's own v, which
    counts its 1/N of the batch's noise N times; "batch": an estimate of the v Adam would see on the
    whole batch's mean gradient, from the rank's own moments (no bytes; onebit.batch_second_moment).
    None = "batch", measured the better for both compressors with owe=step (docs/compression.md)."""
    select: str | None = None
    """adam mode, top-k: how the k elements are chosen from x = direction + residual. "agree": the
    largest max(0, x y) with y the rank's current Adam direction (onebit.agreement); "gain": the
    largest max(0, x m) with m the rank's first moment (x m: the first-order loss decrease that
    sending x buys); "x": the largest |x| (DGC's top-k). None = "gain"."""
    owe: str | None = None
    """adam mode: the units of the residual. "step": the lr-scaled update lr_t y (parameter units),
    so a direction held back is applied at the learning rate of the step that computed it;
    "direction": y itself, applied at the lr of the step that sends it. None = "step"."""
    adam_off: bool = False
    """adam=off: plain error feedback whatever the optimizer (no adam mode chosen by default)."""
    clip: float | None = None
    """Local gradient clipping (DGC): each rank scales its bucket's gradient to norm <= clip before
    momentum and compression; None = off (adam mode: the optimizer's clip norm; clip=inf for off)."""

    @property
    def dense_steps(self) -> int:
        return self.start if self.start is not None else (2 if self.name == "powersgd" else 0)

    @property
    def variance(self) -> str:
        """adam mode's second moment: `var`, or the compressor's default."""
        return self.var or "batch"

    @property
    def selection(self) -> str:
        """adam-mode top-k's choice of elements: `select`, or "gain" (measured best)."""
        return self.select or "gain"

    @property
    def owed(self) -> str:
        """adam mode's residual units: `owe`, or "step"."""
        return self.owe or "step"

    @property
    def error_feedback(self) -> bool:
        return self.ef if self.ef is not None else self.name in ("topk", "sign")

    def __str__(self) -> str:
        main = {"topk": f":{self.ratio:g}", "powersgd": f":{self.rank}"}.get(self.name, "")
        adam = ",adam=off" if self.adam_off else ""
        adam += (f",adam={self.adam}" + (",warm=fp32" if self.warm == "fp32" else "")
                + (f",var={self.var}" if self.var else "")
                + (f",select={self.select}" if self.select else "")
                + (f",owe={self.owe}" if self.owe else "")) if self.adam is not None else ""
        return self.name + main + (",batched" if self.batched and self.name == "powersgd" else "") + adam


def _number(spec: str, key: str, text: str, kind: type):
    try:
        return kind(text)
    except ValueError:
        raise ConfigError(f"compression {spec!r}: {key}={text!r} is not a{'n integer' if kind is int else ' number'}") from None


def parse_compression(spec: str | CompressionSpec | None) -> CompressionSpec:
    """Parse a spec string; raises ConfigError (one line) for anything memfit cannot use."""
    if isinstance(spec, CompressionSpec):
        return _validate(spec, str(spec))
    if spec is None or spec.strip() in ("", "none", "off"):
        return CompressionSpec()
    text = spec.strip().lower()
    head, *opts = text.split(",")
    name, _, main = head.partition(":")
    if name not in NAMES:
        raise ConfigError(f"unknown compressor {name!r} in {spec!r}; accepted: {', '.join(NAMES)} "
                          "(e.g. topk:0.01, int8, sign, bf16, fp16, powersgd:4)")
    fields: dict = {"name": name}
    if main:
        if name == "topk":
            fields["ratio"] = _number(spec, "ratio", main, float)
        elif name == "powersgd":
            fields["rank"] = _number(spec, "rank", main, int)
        else:
            opts.insert(0, main)  # "int8:chunk=512": the part after ":" is an option
    for opt in opts:
        key, eq, value = opt.strip().partition("=")
        if key in _FLAGS and not eq:
            fields[key] = True
        elif key in _OPTIONS and eq:
            kinds = {"ratio": float, "momentum": float, "values": str, "warm": str, "clip": float, "var": str,
                     "select": str, "owe": str}
            if key == "ef":
                fields[key] = value in ("1", "true", "on", "yes")
            elif key == "adam" and value in ("off", "none", "no"):
                fields["adam_off"] = True
            else:
                kind = kinds.get(key, int)
                fields[key] = value if kind is str else _number(spec, key, value, kind)
        else:
            raise ConfigError(f"compression {spec!r}: unknown option {opt!r}; options are key=value among "
                              f"{', '.join(sorted(_OPTIONS))} or the flags {', '.join(sorted(_FLAGS))}")
    return _validate(CompressionSpec(**fields), spec)


def _validate(s: CompressionSpec, spec: str) -> CompressionSpec:
    if not 0 < s.ratio <= 1:
        raise ConfigError(f"compression {spec!r}: top-k ratio {s.ratio:g} is outside (0, 1]; e.g. topk:0.01 sends 1%")
    if s.rank < 1:
        raise ConfigError(f"compression {spec!r}: PowerSGD rank {s.rank} must be at least 1; e.g. powersgd:4")
    if s.chunk < 1:
        raise ConfigError(f"compression {spec!r}: chunk={s.chunk} must be at least 1 element")
    if not 0 <= s.momentum < 1:
        raise ConfigError(f"compression {spec!r}: momentum={s.momentum:g} must be in [0, 1)")
    if s.warmup < 0 or s.dense_steps < 0:
        raise ConfigError(f"compression {spec!r}: warmup and start must be >= 0 steps")
    if s.values not in ("bf16", "fp32"):
        raise ConfigError(f"compression {spec!r}: values={s.values!r}; accepted: bf16, fp32")
    if s.momentum and (s.name not in ("topk", "sign") or not s.error_feedback):
        raise ConfigError(f"compression {spec!r}: momentum correction applies to topk and sign with error feedback")
    if s.clip is not None and not s.clip > 0:
        raise ConfigError(f"compression {spec!r}: clip={s.clip:g} must be a positive gradient norm")
    if s.warm not in WARM_CODECS:
        raise ConfigError(f"compression {spec!r}: warm={s.warm!r}; accepted: {', '.join(WARM_CODECS)}")
    if s.var is not None and s.var not in VARIANCES:
        raise ConfigError(f"compression {spec!r}: var={s.var!r}; accepted: {', '.join(VARIANCES)} "
                          "(adam mode's second moment: the whole batch's estimate, or the rank's own)")
    if s.select is not None and s.select not in SELECTIONS:
        raise ConfigError(f"compression {spec!r}: select={s.select!r}; accepted: {', '.join(SELECTIONS)} "
                          "(adam-mode top-k ranks x = direction + residual by max(0, x y), or by |x|)")
    if s.owe is not None and s.owe not in OWED:
        raise ConfigError(f"compression {spec!r}: owe={s.owe!r}; accepted: {', '.join(OWED)} "
                          "(adam mode's residual: lr-scaled steps, or unscaled directions)")
    if s.adam_off and s.name not in ("topk", "sign"):
        raise ConfigError(f"compression {spec!r}: adam=off applies to topk and sign (the compressors with an "
                          "adam mode); leave it out")
    if s.adam is not None:
        _validate_adam(s, spec)
    elif s.var or s.select or s.owe:
        opt = 'var' if s.var else 'select' if s.select else 'owe'
        raise ConfigError(f"compression {spec!r}: {opt}= is adam mode's option; add "
                          f"adam=W (e.g. topk:0.01,adam=5,select=x) or leave it out")
    if s.select and s.name != "topk":
        raise ConfigError(f"compression {spec!r}: select= chooses top-k's elements; {s.name} sends every element, "
                          "leave it out")
    return s


def _validate_adam(s: CompressionSpec, spec: str) -> None:
    if s.name not in ("topk", "sign") or not s.error_feedback:
        raise ConfigError(f"compression {spec!r}: adam= (compressed Adam update) applies to topk and sign "
                          "with error feedback; e.g. sign:adam=12 or topk:0.01,adam=12")
    if s.adam < 0:
        raise ConfigError(f"compression {spec!r}: adam={s.adam} warm-up steps must be 0 or more")
    if s.momentum or s.start:
        raise ConfigError(f"compression {spec!r}: with adam= the momentum is the optimizer's beta1 and the "
                          "warm-up is adam=N itself; leave out momentum= and start=")


_WHY_NOT = {
    "none": "one process has no gradient exchange to compress; add --strategy ddp, zero1 or zero2 "
            "(and --nproc N)",
    "zero3": "zero3 reduce-scatters each block's gradients inside its gather/free pipeline as "
             "backward produces them and frees the full gradient at once; error feedback needs a "
             "full-size residual per rank (the memory zero3 exists to remove) and that pipeline has "
             "no point to exchange a compressed payload; use ddp, zero1 or zero2",
    "tensor": "tensor parallelism splits each layer's weights over ranks, so no rank holds a full "
              "gradient to compress and its collectives carry activations, not gradients; use ddp, "
              "zero1 or zero2 (or compress only the data-parallel dimension there)",
    "pipeline": "pipeline stages hold different parameters, so there is no gradient reduction "
                "between them to compress; use ddp, zero1 or zero2",
    "ps": "the parameter-server baseline reduces gradients to one rank uncompressed by design; use "
          "ddp, zero1 or zero2",
}


def check_compression_strategy(strategy: str, spec: str | CompressionSpec | None,
                               optimizer: str | None = None) -> CompressionSpec:
    """Parse `spec` and check that `strategy` (and `optimizer`, when given) can carry it; ConfigError
    (one line) otherwise."""
    parsed = parse_compression(spec)
    if parsed.adam is not None and optimizer is not None and optimizer not in ("adam", "adamw"):
        raise ConfigError(f"--compress {spec}: adam= (compressed Adam update) works with the adam and adamw "
                          f"optimizers, not {optimizer}; leave out adam= (momentum= suits SGD)")
    if parsed.name == "none" or strategy in STRATEGIES_WITH_COMPRESSION:
        if parsed.name == "powersgd" and not parsed.batched and strategy != "ddp":
            raise ConfigError(f"--compress {spec}: torch's powerSGD_hook is a DDP comm hook; with "
                              f"{strategy} use the batched variant: powersgd:{parsed.rank},batched")
        return parsed
    reason = _WHY_NOT.get(strategy, f"strategy {strategy!r} has no gradient reduction that memfit compresses")
    raise ConfigError(f"--compress {spec} does not apply to --strategy {strategy}: {reason}")
