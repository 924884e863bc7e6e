"""speculative_decoding: throughput speed-up of speculative decoding over plain decoding against the batch size,
for several acceptance rates and draft lengths; the batch size at which speculation stops paying.

In the simulator the acceptance rate is configured (``spec.acceptance_rate``). On the engine (``study.engine``) it
is measured (n-gram drafts on the tiny model), and the CPU-scale simulation takes each engine run's measured
acceptance, so the two answer the same question.
"""

from __future__ import annotations

import json
from pathlib import Path

from omegaconf import DictConfig

from experiments import plots
from experiments.studies.common import Report, backends, fmt, get, run_variants, slug

PANELS = [("speedup", "throughput speed-up (x)", 1.0), ("tpot_ratio", "TPOT p50 speed-up (x)", 1.0)]


def variants(c: DictConfig) -> dict[str, list[str]]:
    """Label -> overrides of the speculative variants (plus the plain baseline ``off``)."""
    s = c.study
    out: dict[str, list[str]] = {"off": ["spec=none"]}
    for a in s.alphas:
        out[f"k={s.k} alpha={a:g}"] = [f"spec.num_speculative_tokens={s.k}", f"spec.acceptance_rate={a}"]
    for k in s.ks:
        alpha = [f"spec.acceptance_rate={s.alpha_for_k}"] if s.alphas else []  # none: measured on the engine
        out[f"k={k} alpha={s.alpha_for_k:g}" if s.alphas else f"k={k}"] = [f"spec.num_speculative_tokens={k}", *alpha]
    return out


def run(cfg: DictConfig, out: Path) -> Report:
    rep = Report("Speculative decoding: speed-up against batch size")
    rep.text(f"Model {cfg.model.name} on {cfg.hardware.name}, drafts from `{cfg.spec.method}`"
             + (f" ({cfg.spec.draft_model})" if cfg.spec.method == "draft" else "")
             + f". Closed loop: B clients with no think time, so B sequences decode at once; "
               f"{cfg.workload.output_len.value} output tokens per request. Speed-up = output throughput with "
               "speculation / without, at the same B (above 1: speculation pays).")
    measured: dict[tuple[str, int], float] = {}  # (variant, B) -> engine-measured alpha, for the cpu-scale sim
    runs_by: dict[str, dict[str, dict[int, dict]]] = {}
    rows: list[dict] = []  # speedup.json: every (backend, variant, batch size) speed-up
    order = sorted(backends(cfg).items(), key=lambda kv: "sim (cpu" in kv[0])  # the engine before its simulation
    for backend, c in order:
        sizes = [int(b) for b in c.study.batch_sizes]
        per = int(c.study.requests_per_client)
        for b in sizes:
            base = [f"workload.num_clients={b}", f"workload.num_requests={per * b}"]
            labels = variants(c)
            over = {f"{v} B={b}": [*base, *o] for v, o in labels.items()}
            if backend == "sim (cpu scale)":  # the engine's measured acceptance for each variant and size
                over = {lab: [*o, f"spec.acceptance_rate={measured[(lab.rsplit(' B=', 1)[0], b)]!r}"]
                        if (lab.rsplit(" B=", 1)[0], b) in measured else o for lab, o in over.items()}
            res = run_variants(c, over, out / slug(backend) / f"B{b}")
            for lab, m in res.items():
                v = lab.rsplit(" B=", 1)[0]
                runs_by.setdefault(backend, {}).setdefault(v, {})[b] = m
                if backend.startswith("engine") and m.get("draft_acceptance_alpha") is not None:
                    measured[(v, b)] = m["draft_acceptance_alpha"]
        table = []
        for v, by_b in runs_by[backend].items():
            if v == "off":
                continue
            ups = {b: _ratio(by_b[b].get("throughput_tok_s"), runs_by[backend]["off"][b].get("throughput_tok_s"))
                   for b in sizes}
            rows += [{"backend": backend, "variant": v, "batch_size": b, "speedup": u} for b, u in ups.items()]
            stop = next((b for b in sizes if ups[b] is not None and ups[b] < 1), None)
            src = f"speedup.json:rows.{len(rows) - len(sizes)}.speedup"  # the row of the smallest batch size
            table.append([v, rep.number(f"{backend}.{v}.speedup_B{sizes[0]}", ups[sizes[0]], src),
                          fmt(max(u for u in ups.values() if u is not None)),
                          fmt(stop) if stop else f"> {sizes[-1]}",
                          fmt(by_b[sizes[0]].get("draft_acceptance_alpha"))])
        rep.text(f"## {backend}", f"{c.model.name} on {c.hardware.name}, cost model "
                 f"{c.cost_model._target_.rsplit('.', 1)[-1]}, drafts from `{c.spec.method}`"
                 + (f" ({c.spec.draft_model})" if c.spec.method == "draft" else "")
                 + (": acceptance measured on the engine" if backend.startswith("engine") else
                    ": each run takes the engine's measured acceptance" if "cpu scale" in backend else "") + ".")
        rep.table(["variant", f"speed-up at B={sizes[0]}", "best speed-up", "first B where it stops paying",
                   f"measured alpha (B={sizes[0]})"], table)
    (out / "speedup.json").write_text(json.dumps({"rows": rows}, indent=2) + "\n")
    curves = {}
    for backend, by_v in runs_by.items():
        for v, by_b in by_v.items():
            if v == "off":
                continue
            base = by_v["off"]
            curves[v if backend == "sim" else f"{v} ({backend})"] = {
                b: {"speedup": _ratio(m.get("throughput_tok_s"), base[b].get("throughput_tok_s")),
                    "tpot_ratio": _ratio(get(base[b], "tpot_s.p50"), get(m, "tpot_s.p50"))}
                for b, m in by_b.items()}
    even = {key: (1.0, "break-even") for key, _, _ in PANELS}
    fig = plots.metric_curves(curves, PANELS, out / "speedup_vs_batch.png", "sequences decoding at once (B)",
                              logx=True, targets=even)
    rep.figure(fig, "Speed-up of speculative decoding over plain decoding against the batch size (1 = break-even)")
    return rep


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None
