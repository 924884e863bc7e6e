"""Open-loop synthetic requests: an arrival process plus prompt/output length distributions."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from core.checks import check_int
from core.request import Request
from core.workload.arrivals import TraceArrivals, make_arrivals
from core.workload.base import (
    ARRIVALS,
    OUTPUT,
    PROMPT,
    TENANT,
    OpenLoop,
    bounded,
    check_bound,
    rng,
    tenant_name,
)
from core.workload.lengths import make_length


class SyntheticWorkload(OpenLoop):
    """Requests ``r0, r1, ...`` with unique prompt content (no prefix sharing).

    Stops after ``num_requests`` requests or at ``duration_s`` (arrival time), whichever comes first;
    ``num_requests`` counts warmup requests too (the first ``warmup_requests`` are flagged warmup).
    With ``num_tenants`` > 1 each request goes to a uniformly drawn tenant.
    """

    def __init__(self, arrival: Mapping[str, Any], prompt_len: Mapping[str, Any] | int,
                 output_len: Mapping[str, Any] | int, num_requests: int | None = None,
                 duration_s: float | None = None, warmup_requests: int = 0, num_tenants: int = 1,
                 priority: int = 0, seed: int = 0) -> None:
        self.arrival = make_arrivals(arrival)
        check_bound(num_requests, duration_s, required=not isinstance(self.arrival, TraceArrivals))
        self.prompt_len = make_length(prompt_len, "prompt_len")
        self.output_len = make_length(output_len, "output_len")
        self.num_requests, self.duration_s = num_requests, duration_s
        self.warmup_requests = check_int(warmup_requests, "workload.warmup_requests", 0)
        if num_requests is not None and self.warmup_requests >= num_requests:
            raise ValueError(f"workload.warmup_requests={warmup_requests}: not below workload.num_requests="
                             f"{num_requests}, so nothing would be measured")
        self.num_tenants = check_int(num_tenants, "workload.num_tenants", 1)
        self.priority = check_int(priority, "workload.priority", -2**31)
        self.seed = check_int(seed, "workload.seed", 0)

    def initial(self) -> Iterator[Request]:
        s = self.seed
        prompts, outputs = self.prompt_len.stream(rng(s, PROMPT)), self.output_len.stream(rng(s, OUTPUT))
        tenants = rng(s, TENANT)
        for i, t in bounded(self.arrival.times(rng(s, ARRIVALS)), self.num_requests, self.duration_s):
            tenant = tenant_name(int(tenants.integers(self.num_tenants)), self.num_tenants)
            yield Request(id=f"r{i}", arrival_s=t, prompt_len=next(prompts), max_new_tokens=next(outputs),
                          tenant=tenant, priority=self.priority, warmup=i < self.warmup_requests)
