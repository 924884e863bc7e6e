"""chunk_tradeoff: sweep the chunked-prefill token budget on chat traffic plus long documents.

Per budget: the decoding requests' stalls (p99 and largest per-request max stall, p99 ITL) against the new
requests' first tokens (TTFT, prefill completion = first token - first scheduled, long-prompt TTFT), and the
goodput under the TTFT + max-stall SLO, whose peak is the headline.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from core.metrics import bucket_labels
from experiments import plots
from experiments.studies.common import Report, backends, ci_text, fmt, get, option_name, run_variants, slug


def run(cfg: DictConfig, out: Path) -> Report:
    long_group = bucket_labels(list(cfg.metrics.prompt_len_edges))[-1]
    columns = [("max_stall_s.p50", "median max stall (ms)", 1e3), ("max_stall_s.p99", "p99 max stall (ms)", 1e3),
               ("itl_s.p99", "p99 ITL (ms)", 1e3), ("ttft_s.p50", "TTFT p50 (s)", 1.0),
               ("ttft_s.p99", "TTFT p99 (s)", 1.0), (f"groups.prompt_len.{long_group}.ttft_s.p50",
                                                      f"TTFT p50, prompts {long_group} (s)", 1.0),
               ("prefill_span_s.p99", "p99 prefill completion (s)", 1.0), ("goodput_rps", "goodput (req/s)", 1.0),
               ("throughput_tok_s", "output throughput (tok/s)", 1.0)]
    rep = Report("Chunk size trade-off: decode stalls vs new requests' first tokens")
    rep.text(f"Scheduler `{option_name(cfg, 'scheduler')}`, token budget per step swept (a step's prefill chunk is at "
             "most the budget minus that step's decode tokens); "
             f"SLO: TTFT <= {cfg.slo.ttft_s} s and max stall <= {cfg.slo.max_stall_s} s. Model {cfg.model.name} on "
             f"{cfg.hardware.name} ({cfg.cost_model._target_.rsplit('.', 1)[-1]}). Stall and ITL columns describe "
             "requests that were decoding; TTFT and prefill completion describe requests that were starting.")
    curves = {}
    for backend, c in backends(cfg).items():
        budgets = [int(b) for b in c.study.budgets]
        runs = run_variants(c, {f"budget={b}": [f"scheduler.max_num_batched_tokens={b}"] for b in budgets},
                            out / slug(backend))
        curves[backend] = {b: runs[f"budget={b}"] for b in budgets}
        best = max(budgets, key=lambda b: (get(curves[backend][b], "goodput_rps") or 0.0, -b))
        lo, hi = budgets[0], budgets[-1]
        src = f"{slug(backend)}/budget={best}/metrics.json:goodput_rps"
        top = get(curves[backend][best], "goodput_rps")
        peak = rep.number(f"{backend}.best_goodput_rps", top, src) + ci_text(curves[backend][best], "goodput_rps")
        near = [b for b in budgets if (get(curves[backend][b], "goodput_rps") or 0.0) >= 0.99 * (top or 0.0)]
        rep.text(f"## {backend}",
                 f"**Goodput peaks at budget {best}: {peak}"
                 f" req/s** (SLO attainment {fmt(get(curves[backend][best], 'slo_attainment'))}; within 1% of the "
                 f"peak: budgets {', '.join(map(str, near))}). "
                 f"Budget {lo}: p99 max stall {fmt(get(curves[backend][lo], 'max_stall_s.p99'), 1e3)} ms, TTFT p99 "
                 f"{fmt(get(curves[backend][lo], 'ttft_s.p99'))} s; budget {hi}: p99 max stall "
                 f"{fmt(get(curves[backend][hi], 'max_stall_s.p99'), 1e3)} ms, TTFT p99 "
                 f"{fmt(get(curves[backend][hi], 'ttft_s.p99'))} s.")
        rep.metric_table({str(b): m for b, m in curves[backend].items()}, columns, first="budget (tokens)")
    fig = plots.metric_curves(curves, columns, out / "chunk_tradeoff.png", "token budget per step (tokens)",
                              logx=True)
    rep.figure(fig, "Decode stalls (top) and first-token latency, goodput and throughput against the token budget "
                    "(dashed: the max-stall and TTFT SLO targets)")
    return rep
