"""The simulator's ``core.interfaces.KVTransport``: a transfer's time from its bytes and a link."""

from __future__ import annotations

from collections.abc import Sequence

from core.links import Link


class LinkTransport:
    """Prices a request's KV move as ``num_tokens * kv_bytes_per_token`` bytes over ``link`` (bandwidth, latency).
    KV bytes per token come from the model arithmetic (``core.arithmetic.kv_bytes_per_token``)."""

    def __init__(self, link: Link, kv_bytes_per_token: float) -> None:
        self.link = link
        self.kv_bytes_per_token = kv_bytes_per_token

    def transfer(self, src: int, dst: int, src_blocks: Sequence[int], dst_blocks: Sequence[int],
                 num_tokens: int) -> float:
        return self.link.seconds(num_tokens * self.kv_bytes_per_token)
