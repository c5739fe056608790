"""Interconnects for the cluster planner: bandwidth and latency per link, and a collective's seconds.

    link = parse_interconnect("nvlink")          # Link(name, bytes_per_s, latency_s)
    link = parse_interconnect("25")              # 25 GB/s, PCIe's latency
    Topology(gpus=16, nodes=2, intra=link).group_link(group=8, stride=1)   # inside a node: NVLink

Figures are per GPU and per direction, for the bandwidth a ring collective sees (what the
formulas in memfit.distributed.comm count bytes against). They are the usual published figures
for the hardware generation, not measurements:

    nvlink   NVLink 4 (H100 SXM): 900 GB/s both ways, 450 GB/s each way; ~5 us per hop
    pcie     PCIe 5 x16: 64 GB/s each way nominal, ~32 GB/s achieved by a ring; ~10 us
    ib       one 400 Gb/s InfiniBand NDR port per GPU: 50 GB/s; ~10 us

A group that spans nodes runs at the inter-node link's speed (`per_node` GPUs in a node, 8 unless
`--nodes K` splits the GPUs evenly; ranks numbered node by node, so a group of consecutive ranks
within a node stays on the intra-node link, which `--interconnect` names; between nodes: ib, or
the intra-node link when that is slower). A number is taken as GB/s. `loopback` (or `measured`):
gloo between ranks on this machine, measured once and cached (memfit.plan.cluster_host).
"""
from __future__ import annotations

from dataclasses import dataclass

from memfit.core.errors import ConfigError
from memfit.plan.cluster_link import Link


LINKS = {
    "nvlink": Link("nvlink", 450e9, 5e-6),
    "pcie": Link("pcie", 32e9, 10e-6),
    "ib": Link("ib", 50e9, 10e-6),
}


def parse_interconnect(value: str | float | None) -> Link:
    """A link name (nvlink, pcie, ib, loopback) or a bandwidth in GB/s; None: nvlink."""
    if value is None:
        return LINKS["nvlink"]
    if isinstance(value, Link):
        return value
    text = str(value).strip().lower()
    if text in LINKS:
        return LINKS[text]
    if text in ("loopback", "measured"):
        from memfit.plan.cluster_host import loopback_link

        return loopback_link()
    try:
        gbs = float(text.removesuffix("gb/s").removesuffix("gbs"))
    except ValueError:
        raise ConfigError(f"unknown interconnect {value!r}; use nvlink, pcie, ib, loopback (measured "
                          "here) or a bandwidth in GB/s (e.g. 25)") from None
    if gbs <= 0:
        raise ConfigError(f"interconnect bandwidth must be positive, got {value!r}")
    return Link(f"{gbs:g} GB/s", gbs * 1e9, LINKS["pcie"].latency_s)


@dataclass(frozen=True)
class Topology:
    """`gpus` devices, `per_node` in a node; `intra` inside a node, `inter` between nodes."""

    gpus: int
    per_node: int = 8
    intra: Link = LINKS["nvlink"]
    inter: Link = LINKS["ib"]

    @property
    def nodes(self) -> int:
        return -(-self.gpus // self.per_node)

    def group_link(self, group: int, stride: int = 1) -> Link:
        """The slowest link a group of `group` ranks, `stride` apart, crosses."""
        if group <= 1:
            return self.intra
        return self.intra if group * stride <= self.per_node else self.inter


def ring_seconds(link: Link, sent_bytes: float, group: int, steps: int = 1) -> float:
    """Seconds of a collective over a ring of `group` ranks in which each rank sends `sent_bytes`
    (the ring formulas of memfit.distributed.comm), plus a latency per ring step."""
    if group <= 1 or sent_bytes <= 0:
        return 0.0
    return sent_bytes / link.bytes_per_s + steps * (group - 1) * link.latency_s


def topology(gpus: int, interconnect: str | float | None = None, nodes: int | None = None,
             per_node: int = 8) -> Topology:
    """The topology of `gpus` devices: over `nodes` nodes when given (evenly), else `per_node` a node."""
    intra = parse_interconnect(interconnect)
    if nodes is not None:
        if nodes < 1 or gpus % nodes:
            raise ConfigError(f"{gpus} GPUs do not split evenly over {nodes} nodes; use a --nodes dividing --gpus")
        per_node = gpus // nodes
    inter = min(intra, LINKS["ib"], key=lambda link: link.bytes_per_s)
    return Topology(gpus, per_node, intra, inter)
