"""Replay: feed a run's measured step durations (its steps.csv) back through the simulator.

Both backends drive the same replica core with the same driver, so a simulation of the same config and workload
whose steps take exactly the recorded durations must schedule exactly the recorded batches and reproduce every
request timestamp. A replayed step whose batch differs from the recorded one is a *logic* difference between the
runs (scheduler, KV accounting, driver), never a timing one: ``ReplayExecutor`` raises ``ReplayDivergence`` at the
first such step, naming the replica, the step and the features that differ. What remains between a simulation
and the engine is then the cost model's error alone.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import astuple, dataclass
from pathlib import Path

from core.batch import Batch, StepFeatures
from core.interfaces import BaseExecutor, StepOutput
from core.output import read_step_features, read_tokens


@dataclass(frozen=True, slots=True)
class RecordedStep:
    features: StepFeatures
    duration_s: float


class ReplayDivergence(ValueError):
    """A replayed batch differs from the recorded one (or the replay ran out of / left over recorded steps)."""


def feature_diff(expected: StepFeatures, got: StepFeatures) -> dict[str, tuple[int, int]]:
    """Feature name -> (recorded, replayed) for every feature that differs."""
    return {k: (a, b) for k, a, b in zip(StepFeatures.names(), astuple(expected), astuple(got), strict=True) if a != b}


class ReplayExecutor(BaseExecutor):
    """One replica's executor: step i takes the i-th recorded duration after checking the batch's features.

    It measures nothing (no ``stopwatch``): a recorded duration already includes whatever the recording run
    added (e.g. the engine's measured scheduling time). Tokens are placeholders (``token_id``), so replay
    reproduces runs whose requests generate a fixed number of tokens (``ignore_eos``, the sim-vs-engine setting).
    """

    def __init__(self, steps: Sequence[RecordedStep], replica: int = 0, token_id: int = 0,
                 events: dict[str, deque[int]] | None = None) -> None:
        self.steps = list(steps)
        self.replica = replica
        self.token_id = token_id
        self.position = 0
        # speculative decoding: each request's recorded output events (tokens per step that sampled for it), so a
        # verify step yields the tokens it yielded when recorded; None: the recording has no drafts
        self.events = events

    def execute(self, batch: Batch) -> StepOutput:
        i = self.position
        if i >= len(self.steps):
            raise ReplayDivergence(f"replica {self.replica} step {i}: the replay runs a step the recording does not "
                                   f"have (recorded {len(self.steps)} steps); replayed features {batch.features}")
        rec = self.steps[i]
        diff = feature_diff(rec.features, batch.features)
        if diff:
            detail = ", ".join(f"{k}: recorded {a}, replayed {b}" for k, (a, b) in diff.items())
            raise ReplayDivergence(f"replica {self.replica} step {i}: batch differs from the recording ({detail}); "
                                   f"recorded {rec.features}, replayed {batch.features}")
        self.position = i + 1
        if not batch.features.num_draft_tokens:
            n = sum(1 for ch in batch.chunks if ch.samples)
            if self.events is not None:
                for ch in batch.chunks:
                    if ch.samples:
                        self._next_event(ch.state.id, i)
            return StepOutput([self.token_id] * n, rec.duration_s)
        if self.events is None:
            raise ReplayDivergence(f"replica {self.replica} step {i}: the step verifies draft tokens; replaying it "
                                   "needs the recording's tokens.csv (how many tokens each verify step yielded)")
        counts = [self._next_event(ch.state.id, i) for ch in batch.chunks if ch.samples]
        return StepOutput([self.token_id] * sum(counts), rec.duration_s, counts)

    def _next_event(self, request_id: str, step: int) -> int:
        queue = self.events.get(request_id)
        if not queue:
            raise ReplayDivergence(f"replica {self.replica} step {step}: request {request_id} samples more often "
                                   "than its recorded output events")
        return queue.popleft()

    @property
    def remaining(self) -> int:
        return len(self.steps) - self.position

    def finish(self) -> None:
        """Raise if recorded steps were never replayed (the replay finished its work earlier than the recording)."""
        if self.remaining:
            raise ReplayDivergence(f"replica {self.replica}: replay ended after {self.position} steps, the recording "
                                   f"has {len(self.steps)}; first unreplayed: {self.steps[self.position].features}")


def load_recording(path: str | Path) -> dict[int, list[RecordedStep]]:
    """Per replica, its recorded steps in step order, from a run directory or its steps.csv."""
    path = Path(path)
    if path.is_dir():
        path = path / "steps.csv"
    if not path.is_file() and not path.with_suffix(".parquet").is_file():
        raise ValueError(f"replay: no steps.csv at {path}")
    features, durations, replicas = read_step_features(path)
    out: dict[int, list[RecordedStep]] = {}
    for f, d, r in zip(features, durations.tolist(), replicas.tolist(), strict=True):
        out.setdefault(int(r), []).append(RecordedStep(f, float(d)))
    return out


def load_events(path: str | Path) -> dict[str, deque[int]]:
    """Per request, the token counts of its output events in order (a run directory's tokens file, CSV or
    Parquet, through ``core.output.read_tokens``)."""
    try:
        cols = read_tokens(path)
    except FileNotFoundError as e:
        raise ValueError(f"replay: {e} (a run with speculative decoding replays its token counts from it)") from None
    out: dict[str, deque[int]] = {}
    for rid, n in zip(cols["request_id"].tolist(), cols["num_tokens"].tolist(), strict=True):
        out.setdefault(rid, deque()).append(int(n))
    return out


def replay_executors(path: str | Path, num_replicas: int, token_id: int = 0) -> list[ReplayExecutor]:
    """One ReplayExecutor per replica from a recorded run (steps.csv rows are in step order per replica); a run
    with speculative decoding also replays each verify step's token count from its tokens.csv."""
    rec = load_recording(path)
    extra = sorted(set(rec) - set(range(num_replicas)))
    if extra:
        raise ReplayDivergence(f"replay: the recording has steps of replicas {extra}, the config has {num_replicas}")
    spec = any(s.features.num_draft_tokens for steps in rec.values() for s in steps)
    events = load_events(Path(path).parent if Path(path).is_file() else path) if spec else None
    return [ReplayExecutor(rec.get(i, []), i, token_id, events) for i in range(num_replicas)]
