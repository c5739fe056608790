"""Which checkpoint layout a strategy writes, and which runs could not write theirs (memfit.train.portable)."""
from __future__ import annotations

from memfit.core.errors import ConfigError

KINDS = {"none": "pt", None: "pt", "ddp": "pt", "ps": "pt", "zero1": "zero", "zero2": "zero", "zero3": "zero",
         "pipeline": "mp", "tensor": "mp"}


def kind(strategy: str | None, engine: str | None = None) -> str:
    """pt (checkpoint.pt alone), zero (memfit's flat shards), mp (pipeline/tensor) or fsdp2 (FSDP2's DCP folder)."""
    return "fsdp2" if engine == "fsdp2" else KINDS[strategy]


def kind_of(config: dict) -> str:
    """The layout a checkpoint's saved config wrote."""
    return kind(config.get("strategy"), config.get("engine"))


def check_checkpointable(strategy: str | None, optimizer: str) -> None:
    """Refuse, before the first step, a run whose checkpoints could not be written or read back: the
    8/4-bit optimizers' quantized state under zero1-3, pipeline and tensor, and Adafactor's factored
    state under pipeline and tensor (their checkpoints hold states of the parameters' shape)."""
    from memfit.apply.optimizers import info

    spec = info(optimizer)
    where = kind(strategy)
    if where == "pt" or not (spec.bits or (where == "mp" and spec.states == 0 and spec.name != "sgd")):
        return
    raise ConfigError(f"--optimizer {spec.name} with --strategy {strategy}: its checkpoints cannot be written "
                      "(they hold optimizer states of the parameters' shape); use adamw, adam, sgd, momentum, lion, "
                      "adagrad or rmsprop" + (", or adafactor" if where == "zero" else ""))
