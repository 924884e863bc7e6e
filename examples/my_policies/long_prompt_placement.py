"""A user's own PD placement policy (docs/policies.md, "Placement"): long prompts go where KV is plentiful, short
ones where the queue is short. Selected with
``python -m experiments.run cluster=pd placement._target_=my_policies.long_prompt_placement.LongPromptPlacement``
(with ``examples/`` on the Python path)."""

from collections.abc import Sequence

from core.checks import check_int
from core.interfaces import ReplicaView
from core.request import Request


class LongPromptPlacement:
    def __init__(self, long_prompt: int = 1024) -> None:
        self.long_prompt = check_int(long_prompt, "placement.long_prompt", 1)

    def place(self, request: Request, replicas: Sequence[ReplicaView]) -> int:
        if request.prompt_len >= self.long_prompt:  # its KV is large: the pool with the most room
            return max(range(len(replicas)), key=lambda i: (replicas[i].num_free_blocks, -i))
        return min(range(len(replicas)), key=lambda i: (replicas[i].num_outstanding, i))
