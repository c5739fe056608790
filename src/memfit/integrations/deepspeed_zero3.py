"""DeepSpeed ZeRO-3's own per-rank buffers and gathered weights, from its config (DeepSpeed not needed).

    s = read_zero3(path, zero_section)              # the keys below, DeepSpeed's defaults where absent
    zero3_buffers(s, partitions(numels, world), weight_bytes=4, fp32_weights=True, offloaded=False)
    gathered_numel(module_params(model), s, persistent(model, s))   # whole weights held at forward's end

What DeepSpeed 0.19 holds under ZeRO-3 beside the rank's partition of the weights and its optimizer state
(deepspeed/runtime/zero/stage3.py, partition_parameters.py, partitioned_param_coordinator.py):

- grad_partitions_flat_buffer: the rank's gradient partition, allocated whole (zeros) when the optimizer is
  built and kept for good, in `data_types.grad_accum_dtype` (default: the weights' dtype); with the
  optimizer offloaded it is host memory.
- the IPG bucket: `reduce_bucket_size` elements of the weights' dtype, allocated whole with
  `contiguous_gradients` (default true); one per dtype, `overlap_comm` adds none under stage 3. Gradients are
  copied into it as backward makes them and reduce-scattered from it into the partition buffer.
- fp32_partitioned_groups_flat: the fp32 partition the optimizer steps. With 16-bit weights it is the master
  copy memfit already counts; with fp32 weights it is a second copy of the partition (host memory when offloaded).
- the step flattens each `sub_group_size` sub-group's gradients into one fp32 tensor before stepping it.
- whole weights: a parameter of at most `stage3_param_persistence_threshold` elements is never partitioned
  (while the persisted total stays within `stage3_model_persistence_threshold`). After the first step
  (which records the module trace) a module's weights are released after it runs only if no module within
  `stage3_max_reuse_distance` elements of the trace uses them again; so a model whose forward-plus-backward
  distance is under that (DeepSpeed's default 1e9 elements) ends its forward with every weight gathered.
  Ahead of each module, `stage3_prefetch_bucket_size` elements of the next weights not held are gathered
  (less when `stage3_max_live_parameters` are already held).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Iterable

from memfit.core.errors import ConfigError

_DTYPE_BYTES = {"fp32": 4, "float32": 4, "float": 4, "fp16": 2, "float16": 2, "half": 2, "bf16": 2,
                "bfloat16": 2}


@dataclass(frozen=True)
class Zero3Settings:
    """zero_optimization keys (and data_types.grad_accum_dtype) with DeepSpeed 0.19's defaults
    (deepspeed/runtime/zero/config.py, DeepSpeedZeroConfig)."""
    reduce_bucket: int = int(5e8)
    contiguous: bool = True
    prefetch_bucket: int = int(5e7)
    persistence: int = int(1e5)
    model_persistence: int = sys.maxsize
    max_live: int = int(1e9)
    max_reuse: int = int(1e9)
    sub_group: int = int(1e9)
    grad_bytes: int | None = None
    """Bytes per gradient element (data_types.grad_accum_dtype); None: the weights' dtype."""


_KEYS = {"reduce_bucket": "reduce_bucket_size", "prefetch_bucket": "stage3_prefetch_bucket_size",
         "persistence": "stage3_param_persistence_threshold", "model_persistence": "stage3_model_persistence_threshold",
         "max_live": "stage3_max_live_parameters", "max_reuse": "stage3_max_reuse_distance",
         "sub_group": "sub_group_size"}
_ALIASES = {"stage3_prefetch_bucket_size": "prefetch_bucket_size",
            "stage3_param_persistence_threshold": "param_persistence_threshold",
            "stage3_model_persistence_threshold": "model_persistence_threshold",
            "stage3_max_live_parameters": "max_live_parameters", "stage3_max_reuse_distance": "max_reuse_distance"}


def read_zero3(path: str, zero: dict, data_types: dict | None = None) -> Zero3Settings:
    """The ZeRO-3 settings of a config's zero_optimization section (DeepSpeed also reads the keys without
    their stage3_ prefix)."""
    values: dict[str, Any] = {}
    for field, key in _KEYS.items():
        value = zero.get(key, zero.get(_ALIASES.get(key, key)))
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < (field == "reduce_bucket"):
            raise ConfigError(f"--deepspeed {path}: {key} = {value!r} must be a number of elements (memfit does not "
                              "read DeepSpeed's \"auto\": give the number)")
        values[field] = int(value)
    grad = (data_types or {}).get("grad_accum_dtype")
    if grad is not None:
        name = str(grad).lower().replace("torch.", "")
        if name not in _DTYPE_BYTES:
            raise ConfigError(f"--deepspeed {path}: data_types.grad_accum_dtype = {grad!r}; accepted: fp32, fp16, bf16")
        values["grad_bytes"] = _DTYPE_BYTES[name]
    return Zero3Settings(contiguous=bool(zero.get("contiguous_gradients", True)), **values)


def zero3_buffers(s: Zero3Settings, parts: list[int], weight_bytes: int, fp32_weights: bool,
                  offloaded: bool) -> dict[str, int]:
    """Bytes of DeepSpeed's ZeRO-3 buffers on a rank whose partition is `parts` (each tensor's elements on
    this rank, partitions()): `grads` (the gradient partition buffer), `bucket` (the IPG bucket), `copy` (the
    fp32 partition beside fp32 weights), `step` (the step's flat fp32 gradient of the largest sub-group)."""
    shard = sum(parts)
    return {"grads": 0 if offloaded else shard * (s.grad_bytes or weight_bytes),
            "bucket": s.reduce_bucket * weight_bytes if s.contiguous else 0,
            "copy": shard * 4 if fp32_weights and not offloaded else 0,
            "step": 0 if offloaded else max(sub_groups(parts, s.sub_group), default=0) * 4}


def partitions(numels: Iterable[int], world: int) -> list[int]:
    """Each tensor's elements on a rank: DeepSpeed partitions every tensor on its own, padded to the world."""
    return [-(-n // world) for n in numels]


def sub_groups(parts: list[int], size: int) -> list[int]:
    """Elements of each optimizer sub-group (stage3._create_fp16_sub_groups): tensors in order, a group closed
    once it reaches `size` (so it may overrun by one tensor); one group when everything fits."""
    if not size or size >= sum(parts):
        return [sum(parts)] if parts else []
    out, acc = [], 0
    for i, n in enumerate(parts):
        acc += n
        if acc >= size or i == len(parts) - 1:
            out.append(acc)
            acc = 0
    return out


def persistent(params: Iterable[tuple[int, int]], s: Zero3Settings) -> set[int]:
    """Ids of the (id, numel) parameters kept whole on every rank (parameter_offload.mark_persistent_parameters)."""
    out, total = set(), 0
    for pid, n in params:
        if n + total > s.model_persistence:
            continue
        if n <= s.persistence:
            out.add(pid)
            total += n
    return out


def module_params(model: Any) -> list[list[tuple[int, int]]]:
    """Each module that owns weights, in registration order (taken as forward order), with its own
    (not its children's) weights as (id, numel); a tied weight has one id wherever it appears."""
    return [[(id(p), p.numel()) for p in m.parameters(recurse=False)]
            for m in model.modules() if any(True for _ in m.parameters(recurse=False))]


def gathered_numel(modules: list[list[tuple[int, int]]], s: Zero3Settings, persist: set[int]) -> int:
    """Elements of whole weights held when forward ends (the last module run, with its prefetch), replaying
    DeepSpeed's fetch, prefetch and release rules over the trace forward + reversed forward."""
    trace = modules + modules[::-1]
    numel = {pid: n for m in modules for pid, n in m}
    queue = [(pid, step) for step, m in enumerate(trace) for pid, _ in sorted(m)]
    held = set(persist)
    recent: dict[int, int] = {}
    for step, m in enumerate(trace[:len(modules)]):
        todo = {pid for pid, _ in m if recent.get(pid, -1) < step}
        held |= {pid for pid, _ in m}
        queue = queue[len(todo):]  # this module's own entries leave the prefetch queue
        recent.update({pid: step for pid in todo})
        queue = _prefetch(queue, held, numel, recent, s, persist)
        if step == len(modules) - 1:
            return sum(numel.get(pid, 0) for pid in held)
        _release(m, step + 1, trace, held, numel, recent, s, persist)
    return sum(numel.get(pid, 0) for pid in held)


def _prefetch(queue: list, held: set, numel: dict, recent: dict, s: Zero3Settings, persist: set) -> list:
    """The coordinator's prefetch: the next queued weights not held, up to the bucket (the last may overrun
    it); weights already held are passed over. Persistent weights are not counted as live (never gathered)."""
    if s.prefetch_bucket <= 0:
        return queue
    room = min(s.max_live - sum(numel.get(pid, 0) for pid in held - persist), s.prefetch_bucket)
    fetched, i = 0, 0
    while i < len(queue) and fetched < room:
        pid, step = queue[i]
        recent[pid] = max(recent.get(pid, -1), step)
        if pid not in held:
            held.add(pid)
            fetched += numel[pid]
        i += 1
    return queue[i:]


def _release(m: list, step: int, trace: list, held: set, numel: dict, recent: dict, s: Zero3Settings,
             persist: set) -> None:
    """PartitionedParameterCoordinator.__params_to_release: not those prefetched for a later step, nor
    those a module within max_reuse elements of the trace uses again."""
    drop = {pid for pid, _ in m if pid not in persist and recent.get(pid, -1) <= step}
    seen = 0
    for later in trace[step:]:
        if seen >= s.max_reuse or not drop:
            break
        for pid, n in later:
            drop.discard(pid)
            seen += n
    held -= drop
