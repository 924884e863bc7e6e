"""Cost-based routing: the replica where this request would get its first token soonest, by estimate."""

from collections.abc import Sequence

from core.checks import check_float
from core.interfaces import ReplicaView
from core.metrics import prefix_work
from core.request import Request


class CostBasedRouter:
    """argmin over replicas of  queue_delay + prefill_time  (ties -> fewest outstanding, then index):

        queue_delay   = prefill_s_per_token * pending_prefill_tokens + decode_s_per_token * pending_decode_tokens
        prefill_time  = C(n) - C(h),   C(x) = prefill_s_per_token * x + prefill_s_per_pair * x * (x + 1) / 2

    with n the prompt length and h its cached prefix on that replica. The uncached suffix still attends to
    the cached prefix, so a hit saves C(h), not the cost of a prompt h tokens shorter: C(n) - C(h) >= C(n - h).
    ``decode_s_per_token`` is the replica time one pending output token costs, i.e. a decode step's time
    divided by the sequences it decodes. A long queue outweighs a cache hit whenever its delay exceeds C(h).
    """

    def __init__(self, prefill_s_per_token: float = 1e-4, prefill_s_per_pair: float = 2e-9,
                 decode_s_per_token: float = 5e-4) -> None:
        for name, v in (("prefill_s_per_token", prefill_s_per_token), ("prefill_s_per_pair", prefill_s_per_pair),
                        ("decode_s_per_token", decode_s_per_token)):
            check_float(v, f"router.{name}", 0.0)
        self.a, self.b, self.d = prefill_s_per_token, prefill_s_per_pair, decode_s_per_token

    def prefill_s(self, n: int) -> float:
        return float(prefix_work(n, self.a, self.b))

    def estimate_s(self, request: Request, replica: ReplicaView) -> float:
        queue = self.a * replica.pending_prefill_tokens + self.d * replica.pending_decode_tokens
        return queue + self.prefill_s(request.prompt_len) - self.prefill_s(replica.cached_prefix_len(request))

    def route(self, request: Request, replicas: Sequence[ReplicaView]) -> int:
        costs = [self.estimate_s(request, r) for r in replicas]
        return min(range(len(replicas)), key=lambda i: (costs[i], replicas[i].num_outstanding, i))
