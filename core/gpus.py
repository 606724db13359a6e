"""GPU presets from vendor datasheets (dense, no sparsity). Ceilings, not achieved rates: the
sim's roofline applies efficiency factors, and `replay calibrate` replaces both with fits."""

from __future__ import annotations

from dataclasses import dataclass

from core.config import ConfigError


@dataclass(frozen=True)
class GPUSpec:
    name: str
    memory_gb: float  # usable HBM (GB, 1e9 bytes)
    hbm_gb_per_s: float  # datasheet memory bandwidth
    bf16_tflops: float  # dense bf16 tensor-core rate
    price_per_hour: float  # USD, a typical on-demand cloud price, for capacity planning

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gb * 1e9)


GPUS: dict[str, GPUSpec] = {
    # H100 SXM5: 80 GB HBM3, 3.35 TB/s, 989 TFLOP/s bf16 dense
    "h100": GPUSpec("h100", 80.0, 3350.0, 989.0, 2.5),
    # H200 SXM: 141 GB HBM3e, 4.8 TB/s, same compute as H100
    "h200": GPUSpec("h200", 141.0, 4800.0, 989.0, 3.5),
    # A100 SXM4 80GB: 2.039 TB/s, 312 TFLOP/s bf16 dense
    "a100": GPUSpec("a100", 80.0, 2039.0, 312.0, 1.6),
    # L40S: 48 GB GDDR6, 864 GB/s, 362 TFLOP/s bf16 dense
    "l40s": GPUSpec("l40s", 48.0, 864.0, 362.0, 1.0),
}


def get_gpu(name: str) -> GPUSpec:
    try:
        return GPUS[name.lower()]
    except KeyError:
        raise ConfigError(
            f"config key 'gpu': unknown GPU '{name}', expected one of {sorted(GPUS)}"
        ) from None
