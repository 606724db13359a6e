"""GPU presets from vendor datasheets (dense, no sparsity). Ceilings, not achieved rates: the
sim's roofline applies efficiency factors, and `replay calibrate` replaces both with fits."""

from __future__ import annotations

from dataclasses import dataclass

from bubblesim.core.config import ConfigError


@dataclass(frozen=True)
class GPUSpec:
    name: str
    memory_gb: float  # usable HBM (GB, 1e9 bytes)
    hbm_gb_per_s: float  # datasheet memory bandwidth
    bf16_tflops: float  # dense bf16 tensor-core rate
    price_per_hour: float  # USD, a typical on-demand cloud price, for capacity planning
    # GPU-to-GPU link of one GPU, per direction (GB/s): what a ring all-reduce's busbw is
    # measured against (sim.cost.collective); `link` names it
    link_gb_per_s: float = 0.0
    link: str = "none"

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gb * 1e9)


GPUS: dict[str, GPUSpec] = {
    # H100 SXM5: 80 GB HBM3, 3.35 TB/s, 989 TFLOP/s bf16 dense; NVLink 4: 900 GB/s
    # bidirectional per GPU (18 links x 50 GB/s), 450 GB/s each way
    "h100": GPUSpec("h100", 80.0, 3350.0, 989.0, 2.5, 450.0, "nvlink4"),
    # H200 SXM: 141 GB HBM3e, 4.8 TB/s, same compute and NVLink 4 as H100
    "h200": GPUSpec("h200", 141.0, 4800.0, 989.0, 3.5, 450.0, "nvlink4"),
    # A100 SXM4 80GB: 2.039 TB/s, 312 TFLOP/s bf16 dense; NVLink 3: 600 GB/s bidirectional
    "a100": GPUSpec("a100", 80.0, 2039.0, 312.0, 1.6, 300.0, "nvlink3"),
    # L40S: 48 GB GDDR6, 864 GB/s, 362 TFLOP/s bf16 dense; no NVLink: PCIe Gen4 x16, 32 GB/s
    # each way (peer traffic through the host bridge)
    "l40s": GPUSpec("l40s", 48.0, 864.0, 362.0, 1.0, 32.0, "pcie4"),
}


def get_gpu(name: str) -> GPUSpec:
    try:
        return GPUS[name.lower()]
    except KeyError:
        raise ConfigError(
            f"config key 'gpu': unknown GPU '{name}', expected one of {sorted(GPUS)}"
        ) from None
