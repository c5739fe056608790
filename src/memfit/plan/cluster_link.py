"""A link between devices: its name, bandwidth per direction and latency per message (plain data,
shared by the named links in memfit.plan.cluster_links and the measured one in
memfit.plan.cluster_host)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Link:
    name: str
    bytes_per_s: float
    latency_s: float
