"""A twinserve Scheduler plugin as vLLM's scheduler: ``--scheduler-cls
experiments.serving.vllm_adapter.scheduler.TwinserveScheduler`` (the repository on PYTHONPATH).

It subclasses vLLM's ``AsyncScheduler``, so overlap (async scheduling) stays on where vLLM turns it on, and replaces
only ``schedule``: the plugin decides the step over ``VllmSchedulerView`` (vLLM's queues and KV cache manager), and
its ``Batch`` becomes a ``SchedulerOutput`` built as vLLM builds its own. Everything else is vLLM's: the model
runner's output goes through vLLM's ``update_from_output`` (tokens, stop checks, finished requests, freed blocks,
async placeholders), as do aborts, stats and the prefix cache. The plugin comes from Hydra overrides
(``plugin.choose_from``); features the adapter does not carry are refused at start (``support``).
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import vllm

from experiments.serving.vllm_adapter.support import check_supported, check_version, refused_request

check_version(vllm.__version__)  # before touching the private scheduler API below

from vllm.logger import init_logger  # noqa: E402
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.interface import PauseState  # noqa: E402
from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput  # noqa: E402
from vllm.v1.engine import EngineCoreEventType  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from core.batch import Batch  # noqa: E402
from core.interfaces import SchedulerLimits  # noqa: E402
from core.request import RepeatedTokens, Request, RequestState, Status  # noqa: E402
from experiments.serving.vllm_adapter.plugin import PluginChoice, choose_from  # noqa: E402
from experiments.serving.vllm_adapter.view import Admission, VllmSchedulerView  # noqa: E402

logger = init_logger("vllm.twinserve_adapter")  # under "vllm": its handlers print it
READY = (RequestStatus.WAITING, RequestStatus.PREEMPTED)


class TwinserveScheduler(AsyncScheduler):
    """vLLM's scheduler with a twinserve plugin deciding each step (see the module docstring)."""

    def __init__(self, vllm_config: Any, kv_cache_config: Any, *args: Any, **kwargs: Any) -> None:
        check_supported(vllm_config, kv_cache_config)  # first: vLLM's own setup of a refused feature may fail oddly
        super().__init__(vllm_config, kv_cache_config, *args, **kwargs)
        choice = choose_from(additional_config=self.vllm_config.additional_config)
        self.plugin = choice.scheduler
        self.limits = self._limits(choice)
        self._mirrors: dict[str, RequestState] = {}
        self._unannounced: dict[str, Admission] = {}  # admitted, not yet sent to the model runner (no chunk yet)
        self._announced: set[str] = set()  # requests the model runner has seen (a resumed one must be among them)
        logger.info("twinserve scheduler %s (overrides %s): max_num_batched_tokens=%d max_num_seqs=%d",
                    choice.name, list(choice.overrides) or "none", self.limits.max_num_batched_tokens,
                    self.limits.max_num_seqs)

    def _limits(self, choice: PluginChoice) -> SchedulerLimits:
        """The scheduler group's budgets, which must fit vLLM's (its model runner is sized for those)."""
        ours = {"max_num_batched_tokens": (choice.max_num_batched_tokens, self.max_num_scheduled_tokens,
                                           "--max-num-batched-tokens"),
                "max_num_seqs": (choice.max_num_seqs, self.max_num_active_reqs, "--max-num-seqs")}
        for key, (value, cap, flag) in ours.items():
            if value > cap:
                raise ValueError(f"scheduler.{key}={value} ({choice.name}) exceeds vLLM's {flag} {cap}: lower it "
                                 f"(scheduler.{key}={cap} in the overrides) or raise vLLM's {flag}")
        return SchedulerLimits(max_num_batched_tokens=choice.max_num_batched_tokens, max_num_seqs=choice.max_num_seqs,
                               max_model_len=self.max_model_len)

    # ---- requests in and out -----------------------------------------------------------------------------------
    def add_request(self, request: Any) -> None:
        super().add_request(request)
        why = refused_request(request)
        if why:  # ends FINISHED_ERROR in the next update_from_output, as a grammar that failed to compile does
            logger.error("twinserve scheduler: request %s refused: %s are not supported", request.request_id, why)
            self.grammar_compile_error_reqs.add(request.request_id)

    def _free_blocks(self, request: Any) -> None:
        super()._free_blocks(request)
        self._mirrors.pop(request.request_id, None)
        self._unannounced.pop(request.request_id, None)
        self._announced.discard(request.request_id)

    def _mirror(self, req: Any) -> RequestState:
        """The plugin's view of one vLLM request, brought up to date (outputs include in-flight placeholders)."""
        state = self._mirrors.get(req.request_id)
        if state is None:
            extra = getattr(req.sampling_params, "extra_args", None) or {}
            state = RequestState(Request(req.request_id, req.arrival_time, req.num_prompt_tokens, req.max_tokens,
                                         priority=req.priority, ttft_deadline_s=extra.get("ttft_deadline_s")),
                                 replica=0)
            self._mirrors[req.request_id] = state
        n = req.num_output_tokens + req.num_output_placeholders
        if len(state.output_token_ids) != n:
            state.output_token_ids = RepeatedTokens(-1, n)  # the plugin reads counts, never the ids
        state.num_computed_tokens = req.num_computed_tokens
        state.num_preemptions = req.num_preemptions
        state.status = Status.RUNNING if req.status == RequestStatus.RUNNING else \
            Status.PREEMPTED if req.status == RequestStatus.PREEMPTED else Status.WAITING
        return state

    def _schedulable(self, req: Any) -> bool:
        """A running request vLLM would schedule now: not one whose in-flight outputs already reach max_tokens."""
        return not (req.num_output_placeholders > 0
                    and req.num_computed_tokens + 2 - req.num_output_placeholders
                    >= req.num_prompt_tokens + req.max_tokens)

    def _ready(self, req: Any) -> bool:
        """A waiting request that may be admitted now (not refused, not blocked, no deliverable stale output)."""
        return req.status in READY and req.request_id not in self.grammar_compile_error_reqs \
            and not (req.num_stale_output_tokens and not req.drop_stale_output)

    # ---- one step ----------------------------------------------------------------------------------------------
    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        self.current_step += 1
        self.kv_cache_manager.new_step_starts()
        timestamp = time.monotonic()
        running = [self._mirror(r) for r in self.running if self._schedulable(r)]
        # (vLLM's kv_holding_waiting queue only fills with KV connectors or streaming sessions: refused)
        waiting = deque(self._mirror(r) for r in self.waiting if self._ready(r))
        view = VllmSchedulerView(self, self.limits, time.time(), timestamp, running, waiting,
                                 self.requests, self._pause_state == PauseState.UNPAUSED, self._unannounced)
        batch = Batch() if self._pause_state == PauseState.PAUSED_ALL else self.plugin.schedule(view)
        self._check(batch, view)
        if batch.empty and not self.running and view.waiting and self._pause_state == PauseState.UNPAUSED:
            stuck = view.blocked if view.blocked in view.waiting else view.waiting[0]
            logger.error("twinserve scheduler %s could not schedule request %s on an idle engine; it ends with an "
                         "error", type(self.plugin).__name__, stuck.id)
            self.grammar_compile_error_reqs.add(stuck.id)
        return self._output(batch, view, timestamp)

    def _check(self, batch: Batch, view: VllmSchedulerView) -> None:
        """Refuse a batch vLLM's model runner cannot run (as ``core.replica.Replica._validate`` does ours)."""
        name, f = type(self.plugin).__name__, batch.features
        if f.num_batched_tokens > self.limits.max_num_batched_tokens or f.num_seqs > self.limits.max_num_seqs:
            raise RuntimeError(f"{name}: {f.num_batched_tokens} tokens / {f.num_seqs} sequences exceed "
                               f"max_num_batched_tokens {self.limits.max_num_batched_tokens} / max_num_seqs "
                               f"{self.limits.max_num_seqs}")
        seen = set()
        for ch in batch.chunks:
            rid, req = ch.state.id, self.requests.get(ch.state.id)
            if req is None or req.status != RequestStatus.RUNNING or rid in seen or ch.num_draft_tokens:
                raise RuntimeError(f"{name}: request {rid} is not running, scheduled twice or carries drafts")
            seen.add(rid)
            held = len(self.kv_cache_manager.get_blocks(rid).blocks[0]) * self.block_size
            if ch.start != req.num_computed_tokens or held < ch.end:
                raise RuntimeError(f"{name}: request {rid} scheduled tokens [{ch.start}, {ch.end}) with "
                                   f"{req.num_computed_tokens} computed and KV for {held}")

    def _admitted(self, adm: Admission, num_tokens: int, timestamp: float) -> None:
        """The bookkeeping vLLM's scheduler does for a request it admits: prefix-cache and prefill stats, events."""
        req = adm.request
        self.kv_cache_manager.record_prefix_cache_stats(req, adm.num_cached_tokens)
        if req.prefill_stats and req.num_preemptions <= 0:
            req.prefill_stats.set(num_prompt_tokens=req.num_prompt_tokens,
                                  num_local_cached_tokens=adm.num_cached_tokens, num_external_cached_tokens=0)
        if self.log_stats:
            req.record_event(EngineCoreEventType.SCHEDULED, timestamp)
        if req.num_computed_tokens + num_tokens < req.num_tokens:
            self._inflight_prefills.add(req)

    def _output(self, batch: Batch, view: VllmSchedulerView, timestamp: float) -> SchedulerOutput:
        """The plugin's batch as vLLM's ``SchedulerOutput``: the tail of vLLM's ``Scheduler.schedule`` (without the
        connector, encoder, LoRA and spec-decode parts, which are refused at start)."""
        kv = self.kv_cache_manager
        new_reqs, resumed_reqs, running_reqs = [], [], []
        num_scheduled: dict[str, int] = {}
        req_to_new_blocks: dict[str, Any] = {}
        for ch in batch.chunks:
            rid = ch.state.id
            num_scheduled[rid] = ch.num_tokens
            adm = view.admitted.pop(rid, None)  # its first chunk: the model runner learns of it now
            if adm is None:
                running_reqs.append(self.requests[rid])
                req_to_new_blocks[rid] = view.new_blocks.get(rid, kv.empty_kv_cache_blocks)
                continue
            if adm.resumed and rid in self._announced:
                resumed_reqs.append(adm.request)
            else:  # new, or preempted before the model runner ever saw it (admitted, preempted without a chunk)
                new_reqs.append(adm.request)
                self._announced.add(rid)
            req_to_new_blocks[rid] = kv.get_blocks(rid)
            self._admitted(adm, ch.num_tokens, timestamp)
        if self.use_v2_model_runner:
            new_reqs, resumed_reqs = new_reqs + resumed_reqs, []
            new_data = [NewRequestData.from_request(r, req_to_new_blocks[r.request_id].get_block_ids(),
                                                    r._all_token_ids, uses_mrope=self.model_uses_mrope)
                        for r in new_reqs]
        else:
            new_data = [NewRequestData.from_request(r, req_to_new_blocks[r.request_id].get_block_ids(),
                                                    uses_mrope=self.model_uses_mrope) for r in new_reqs]
        cached = self._make_cached_request_data(running_reqs, resumed_reqs, num_scheduled, {}, req_to_new_blocks)
        if not self.use_v2_model_runner:
            self.prev_step_scheduled_req_ids.clear()
            self.prev_step_scheduled_req_ids.update(num_scheduled)
        kv.take_boundary_state_offloads()  # Mamba only (refused); drained every step as vLLM does
        copies, cow_retained = kv.take_kv_cache_block_copies()
        if copies:
            self._free_cow_retained_blocks(cow_retained, self.sched_step_seq + 1)
        total = sum(num_scheduled.values())
        out = SchedulerOutput(
            scheduled_new_reqs=new_data, scheduled_cached_reqs=cached, num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=total, scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={},
            preempted_req_ids=self.reset_preempted_req_ids, finished_req_ids=self.finished_req_ids,
            free_encoder_mm_hashes=self.encoder_cache_manager.get_freed_mm_hashes(),
            new_block_ids_to_zero=self._get_new_block_ids_to_zero(), kv_cache_block_copies=copies or None,
            num_spec_tokens_to_schedule=self.num_spec_tokens,
            ec_manager_metadata=self.encoder_cache_manager.get_manager_metadata())
        if self.defer_block_free and total > 0:
            self.sched_step_seq += 1
        self._update_after_schedule(out)
        return out
