"""The planner's inputs: hardware profiles (``hardware/<name>.json``) and the package's model
files, by shipped name or by path to a file with the same keys."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Union

from megatron_tsp.core import model_shape
from megatron_tsp.core.model_shape import ModelShape, available_models

from . import measured_traffic

HERE = Path(__file__).resolve().parent


GB = 1e9


@dataclass
class HardwareSpec:
    name: str
    peak_bf16_tflops: float
    hbm_gb: float
    gpus_per_node: int
    topology: str  # full_mesh | switch
    link_GBps: float
    links_per_gpu: int
    nic_per_node: int
    nic_gbps: float
    compute_efficiency: float
    comm_efficiency: float
    description: str = ""
    assumptions: List[str] = field(default_factory=list)
    # the measured-traffic compute model (``measured_traffic``): HBM bandwidth, the share of it
    # element-wise kernels sustain, and the floor a kernel costs however small it is
    hbm_GBps: float = 0.0
    hbm_efficiency: float = 0.8
    kernel_launch_us: float = 0.0

    @property
    def nic_GBps_per_gpu(self) -> float:
        return self.nic_per_node * self.nic_gbps / 8 / self.gpus_per_node

    def bandwidth(self, size: int, stride: int = 1, link: str = "collective") -> float:
        """Bytes/s one rank receives at, in a group of ``size`` ranks spaced ``stride`` apart.

        Inside a node: switch -> full link bandwidth for any op; full mesh -> a collective uses
        one link per peer (size-1 links), a P2P step one link. Across nodes: a ring with k members
        per node pushes its inter-node traffic through those k GPUs' NICs (k x NIC share),
        capped by the intra-node bandwidth of the k local members."""
        size = max(size, 2)
        if size * stride <= self.gpus_per_node:
            return self._intra(size, link) * GB * self.comm_efficiency
        k = max(1, min(size, self.gpus_per_node // stride)) if stride < self.gpus_per_node else 1
        inter = k * self.nic_GBps_per_gpu
        bw = min(inter, self._intra(k, link)) if k > 1 else inter
        return bw * GB * self.comm_efficiency

    def _intra(self, size: int, link: str) -> float:
        if self.topology == "switch" or link == "p2p":
            return self.link_GBps
        return min(size - 1, self.links_per_gpu) * self.link_GBps

    @property
    def flops(self) -> float:
        return self.peak_bf16_tflops * 1e12 * self.compute_efficiency

    def kernel_costs(self) -> "measured_traffic.KernelCosts":
        if self.hbm_GBps <= 0:
            raise ValueError(
                f"hardware {self.name!r} gives no hbm_GBps: the measured-traffic compute model "
                "needs it (or use --compute-model flops)"
            )
        return measured_traffic.KernelCosts(
            flops_per_s=self.flops,
            hbm_bytes_per_s=self.hbm_GBps * GB * self.hbm_efficiency,
            launch_s=self.kernel_launch_us * 1e-6,
        )


def _resolve(kind: str, name_or_path: str) -> Path:
    """A hardware profile (``hardware/<name>.json``) by name, or a ``.json`` path."""
    p = Path(name_or_path)
    if p.suffix == ".json" and p.exists():
        return p
    p = HERE / kind / f"{name_or_path.lower()}.json"
    if p.exists():
        return p
    avail = sorted(x.stem for x in (HERE / kind).glob("*.json"))
    what = {"models": "model", "hardware": "hardware profile"}.get(kind, kind)
    raise SystemExit(f"unknown {what} {name_or_path!r}: give one of {avail} or a .json path")


def available(kind: str) -> List[str]:
    """Shipped names: ``models`` (``megatron_tsp/models``, shared with configs and the memory
    tool) or ``hardware``."""
    if kind == "models":
        return available_models()
    return sorted(x.stem for x in (HERE / kind).glob("*.json"))


def load_model(name_or_path: Union[str, ModelShape]) -> ModelShape:
    try:
        return model_shape.load_model(name_or_path)
    except ValueError as exc:
        raise SystemExit(str(exc)) from exc


def load_hardware(name_or_path: Union[str, HardwareSpec]) -> HardwareSpec:
    if isinstance(name_or_path, HardwareSpec):
        return name_or_path
    d = json.loads(_resolve("hardware", name_or_path).read_text())
    intra, nic, eff = d["intra_node"], d["nic"], d["efficiency"]
    return HardwareSpec(
        name=d["name"],
        peak_bf16_tflops=d["peak_bf16_tflops"],
        hbm_gb=d["hbm_gb"],
        gpus_per_node=d["gpus_per_node"],
        topology=intra["topology"],
        link_GBps=intra["link_GBps"],
        links_per_gpu=intra["links_per_gpu"],
        nic_per_node=nic["per_node"],
        nic_gbps=nic["gbps"],
        compute_efficiency=eff["compute"],
        comm_efficiency=eff["comm"],
        description=d.get("description", ""),
        assumptions=d.get("assumptions", []) + ([intra["note"]] if "note" in intra else []),
        hbm_GBps=d.get("hbm_GBps", 0.0),
        hbm_efficiency=eff.get("hbm", 0.8),
        kernel_launch_us=d.get("kernel_launch_us", 0.0),
    )
