"""The one table of GPUs: data-sheet numbers that the MFU (:mod:`depthmix.planning.flops`),
the layout planner (:mod:`depthmix.planning.planner`) and the kernels' roofline floors
(:mod:`depthmix.bench.roofline`) read.

Peaks are dense (no sparsity), from the vendors' data sheets: NVIDIA H100 Tensor Core GPU
(SXM5, PCIe, NVL), NVIDIA H200 and NVIDIA A100 Tensor Core GPU. Memory is what the driver
reports; interconnects are per GPU: NVLink in one direction, the network as a node's NICs
(8 x 400 Gb/s NDR or 8 x 200 Gb/s HDR InfiniBand) over its GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional


@dataclass(frozen=True)
class Device:
    name: str
    tflops: Dict[str, float]
    """Peak TFLOP/s by precision: ``bf16``, ``fp16``, ``fp8`` and ``tf32`` on tensor cores,
    ``fp32`` on CUDA cores."""
    memory_gib: Optional[float] = None
    hbm_tb_s: Optional[float] = None
    """HBM bandwidth (TB/s)."""
    nvlink_gbs: Optional[float] = None
    """Per GPU, one direction, inside a node (GB/s)."""
    network_gbs: Optional[float] = None
    """Per GPU between nodes (GB/s)."""
    gpus_per_node: int = 8


_HOPPER = {"bf16": 989.4, "fp16": 989.4, "fp8": 1978.9, "tf32": 494.7, "fp32": 67.0}

# NVLink 4: 900 GB/s both directions; 8 x 400 Gb/s NDR a node.
H100 = Device("H100 SXM 80GB", _HOPPER, memory_gib=79.6, hbm_tb_s=3.35,
              nvlink_gbs=450.0, network_gbs=50.0)
# 141 GB HBM3e; the H100 SXM's compute, NVLink and network.
H200 = Device("H200 SXM 141GB", _HOPPER, memory_gib=140.4, hbm_tb_s=4.8,
              nvlink_gbs=450.0, network_gbs=50.0)
# NVLink 3: 600 GB/s both directions; 8 x 200 Gb/s HDR a node.
A100 = Device("A100 SXM 80GB", {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5},
              memory_gib=80.0, nvlink_gbs=300.0, network_gbs=25.0)

DEVICES = {
    # fragment of torch.cuda.get_device_name() -> device, most specific first
    "H200": H200,  # and GH200
    "H100 NVL": Device("H100 NVL", {"bf16": 835.0, "fp16": 835.0, "fp32": 60.0}),
    "H100 PCIe": Device("H100 PCIe", {"bf16": 756.0, "fp16": 756.0, "fp32": 51.0}),
    "H100": H100,
    "A100": A100,
}


def device_named(device_name: str) -> Optional[Device]:
    """The table's entry for a name as ``torch.cuda.get_device_name()`` gives it, else None."""
    for fragment, device in DEVICES.items():
        if fragment.lower() in device_name.lower():
            return device
    return None
