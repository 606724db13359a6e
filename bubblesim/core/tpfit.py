"""Does a model fit on the GPUs of one replica at a tensor-parallel degree, and if not, at
which degree would it: the simulator's and the planner's one answer (one line each)."""

from __future__ import annotations

from bubblesim.core.config import Config
from bubblesim.core.gpus import GPUSpec
from bubblesim.core.models import ModelSpec
from bubblesim.core.policy.sizing import ACTIVATION_RESERVE_BYTES, kv_blocks_for_gpu

TP_DEGREES: tuple[int, ...] = (1, 2, 4, 8)  # bubblesim.core.config's tensor_parallel_size values


def gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


def _problem(cfg: Config, model: ModelSpec, gpu: GPUSpec, tp: int) -> str | None:
    """Why `model` does not fit on `tp` x `gpu` under `cfg`'s other keys, or None."""
    split = model.tp_error(tp)
    if split is not None:
        return split
    weights = model.weight_bytes(cfg.dtype, tp)
    need = weights + ACTIVATION_RESERVE_BYTES
    if need >= gpu.memory_bytes:
        return (
            f"{gb(weights)} of weights per GPU + {gb(ACTIVATION_RESERVE_BYTES)} reserve "
            f"leave no room for KV cache in {gb(gpu.memory_bytes)}"
        )
    at = cfg if cfg.tensor_parallel_size == tp else cfg.replace(tensor_parallel_size=tp)
    if kv_blocks_for_gpu(at, model, gpu.memory_bytes) < 1:
        return f"the free {gb(gpu.memory_bytes - need)} per GPU hold no KV block"
    return None


def fitting_degrees(
    cfg: Config, model: ModelSpec, gpu: GPUSpec, degrees: tuple[int, ...] = TP_DEGREES
) -> tuple[int, ...]:
    """The degrees of `degrees` at which the model fits, in order."""
    return tuple(tp for tp in degrees if _problem(cfg, model, gpu, tp) is None)


def fit_error(cfg: Config, model: ModelSpec, gpu: GPUSpec) -> str | None:
    """None if the model fits at cfg.tensor_parallel_size, else one line saying why and at
    which degree (up to 8) it would fit, or that it fits at none."""
    tp = cfg.tensor_parallel_size
    why = _problem(cfg, model, gpu, tp)
    if why is None:
        return None
    where = f"{tp} x {gpu.name}" if tp > 1 else f"one {gpu.name}"
    ok = fitting_degrees(cfg, model, gpu)
    if ok and ok[0] > tp:
        hint = f"it fits at tensor_parallel_size={ok[0]}"
    elif ok:  # a split that fails at tp: list every degree that works
        hint = f"it fits at tensor_parallel_size {', '.join(map(str, ok))}"
    else:
        hint = f"it fits at no tensor_parallel_size up to {TP_DEGREES[-1]}"
    return f"model '{cfg.model}' does not fit on {where} (tensor_parallel_size={tp}): {why}; {hint}"
