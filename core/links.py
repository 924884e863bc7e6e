"""A link the simulator prices data movement on: PD disaggregation's KV transfers, the host KV tier's copies and,
through the hardware presets, the collectives of parallel deployments."""

from __future__ import annotations

from dataclasses import dataclass

from core.checks import check_float


@dataclass(frozen=True, slots=True)
class Link:
    """One direction of a link: moving ``n`` bytes takes ``n / bandwidth_bytes_s + latency_s`` seconds."""

    bandwidth_bytes_s: float
    latency_s: float = 0.0

    def __post_init__(self) -> None:
        check_float(self.bandwidth_bytes_s, "link.bandwidth_bytes_s", 0.0, strict=True)
        check_float(self.latency_s, "link.latency_s", 0.0)

    def seconds(self, num_bytes: float) -> float:
        return num_bytes / self.bandwidth_bytes_s + self.latency_s
