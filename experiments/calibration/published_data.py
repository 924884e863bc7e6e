"""Published GPU step-time measurements as (step shapes, seconds), and the roofline checked and fitted on each.

Files live in ``shared/data/gpu-measurements`` (provenance and licences: ``shared/data/SOURCES.md``). One reader
per source turns rows into ``Dataset``s, one per measured setup (model, GPU, tensor-parallel degree), in seconds:

- ``vidur``: per-operator kernel times of ONE decoder layer at ``num_tokens`` tokens (Vidur, MLSys'24; ms in the
  file). We sum the medians of the four linear operators (QKV proj, out proj, gated MLP up, MLP down) and compare
  them with the roofline's ``linear`` op group of a one-layer model whose shape is read from the file's own columns.
- ``splitwise``: vLLM on DGX-A100 / DGX-H100 (Splitwise, ISCA'24; ms). ``prompt_time``: a prefill of
  ``batch_size`` prompts of ``prompt_size`` tokens, priced as one step. ``token_time``: the mean decode iteration
  over ``token_size`` generated tokens (``e2e_time`` ≈ prompt_time + (token_size − 1)·token_time), priced as a decode
  step of ``batch_size`` sequences at the mean context prompt_size + token_size/2. Collectives come from Vidur's
  NCCL tables of the same nodes (``vidur/network/{a100,h100}_dgx``, as the simulator prices them). The power-capped
  H100's rows are the H100's: ``token_time`` row for row, ``prompt_time`` x 1.30 on every row (scaled in the file).

The host term (``sim.cost.roofline``: a stage lasts max(device, kernels x host_kernel_s)) is a property of the
engine on its host CPU, not of the GPU: ``host_fits`` fits one ``host_kernel_s`` per host node on ONE setup's decode
rows (``SPLITWISE_HOST_FITS``) and ``check_dataset`` predicts every other row with it, held out.
- ``sarathi-serve``: Yi-34B-200K, TP-2 on A100-80GB PCIe (Sarathi-Serve, OSDI'24 artifact; s in figure 2, ms in
  figure 9). Figure 2: one prefill of N tokens; decode batches of B sequences of a 1024-token request (1020 prompt
  + 4 decode tokens, context ≈ 1022). Figure 9: per-request sum of the prefill-only steps of a ``prefill_length``
  prompt split into ``chunk_size`` chunks (each chunk attends to the earlier ones) — a run of steps.
- ``distserve``: NOT raw measurements. DistServe (OSDI'24) publishes least-squares fits of its A100-80GB profiles,
  in ms: prefill = a + b·Σlen + c·Σlen², decode = a + b·Σcontext + c·batch (a second triple above 95 sequences),
  for OPT-13B/66B on its own engine and on vLLM. We evaluate them on DistServe's profiling grid (batch sizes ×
  input lengths within its token limits) to make comparison points; they check shape trends, not raw noise.

Setups run on the repository's model and hardware configs (``conf/model``, ``conf/hardware``); the caller reads them
(``experiments.calibration.published.conf_specs``) and passes them in as ``Specs``.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from core import arithmetic as ar
from core.batch import StepFeatures
from core.specs import HardwareSpec, ModelSpec
from experiments.config import shared_data
from sim.cost.base import decode_features, prefill_features
from sim.cost.roofline import RooflineCostModel
from sim.fit import (
    FITTED_ROOFLINE,
    Measurement,
    OpGroupCost,
    cross_validate,
    fit_host_kernel_s,
    fit_linear,
    fit_roofline,
    predict,
    report,
)

MS = 1e-3

# Yi-34B-200K public config.json: Llama architecture, GQA 56/8 heads, 60 layers.
YI_34B_200K = ModelSpec(name="yi_34b_200k", num_layers=60, hidden_size=7168, num_heads=56, num_kv_heads=8,
                        head_dim=128, intermediate_size=20480, vocab_size=64000, rope_theta=5e6,
                        max_model_len=200000, dtype="bfloat16")


def _opt_twin(name: str, layers: int, hidden: int, heads: int) -> ModelSpec:
    """An OPT model as a Llama-shaped 'arithmetic twin': OPT's ungated 4d MLP (2 matrices of d×4d = 8d² weights)
    has the FLOPs and bytes of a gated MLP of width 8d/3 (3·d·F); heads, layers, tied 50272-token embeddings kept.
    Ignored: biases, learned positions, LayerNorm vs RMSNorm (all tiny next to the matrices)."""
    return ModelSpec(name=name, num_layers=layers, hidden_size=hidden, num_heads=heads, num_kv_heads=heads,
                     head_dim=hidden // heads, intermediate_size=round(8 * hidden / 3), vocab_size=50272,
                     tie_word_embeddings=True, max_model_len=2048, dtype="float16")


OPT_TWINS = {"facebook/opt-13b": _opt_twin("opt_13b_twin", 40, 5120, 40),
             "facebook/opt-66b": _opt_twin("opt_66b_twin", 64, 9216, 72)}
# DistServe's profiling grid (evaluation/0-test-single-forward-performance/main.py @ 82831f1).
DISTSERVE_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 96, 128, 160, 192)
DISTSERVE_INPUT_LENS = (4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 284, 512, 768, 1024, 1536, 2020)
DISTSERVE_TOKEN_LIMITS = {("facebook/opt-13b", 1): 49152, ("facebook/opt-13b", 2): 98304,
                          ("facebook/opt-13b", 4): 250000, ("facebook/opt-66b", 2): 8192,
                          ("facebook/opt-66b", 3): 36864, ("facebook/opt-66b", 4): 65000}
DISTSERVE_OUTPUT_LEN = 16  # decode time is the mean over 16 steps: context input_len + 1 .. + 16
SARATHI_DECODE_CONTEXT = 1022  # 1020 prompt tokens, decode steps at contexts 1021..1023
A100_PCIE_MEM_BW = 1.935e12  # A100 80GB PCIe datasheet HBM2e bandwidth (the SXM part: 2.039e12)
VLLM_MEMORY_FRACTION = 0.9  # vLLM's default gpu_memory_utilization
VIDUR_LINEAR_OPS = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj")


def default_data_dir() -> Path:
    """The published GPU measurements: ``shared/data/gpu-measurements`` beside the checkout."""
    return shared_data("gpu-measurements")


@dataclass(frozen=True)
class Specs:
    """Where setups get their model and hardware specs: by config name (``conf/model/<name>.yaml``,
    ``conf/hardware/<name>.yaml``), read by the caller (``experiments.calibration.published.conf_specs``)."""

    model: Callable[[str], ModelSpec]
    hardware: Callable[[str], HardwareSpec]


@dataclass
class Dataset:
    """One measured setup. ``ops``: only these roofline op groups were timed (None: whole steps)."""

    source: str
    name: str
    model: ModelSpec
    hardware: HardwareSpec
    tp: int
    measurements: list[Measurement]
    seconds: np.ndarray
    labels: list[str]
    ops: tuple[str, ...] | None = None
    derived: bool = False  # points computed from published fitted coefficients, not raw measurements
    network_dir: Path | None = None  # NCCL tables measured on the setup's kind of node (None: the link model)

    def __post_init__(self) -> None:
        self.seconds = np.asarray(self.seconds, dtype=float)
        if not (len(self.measurements) == len(self.seconds) == len(self.labels)) or not len(self.seconds):
            raise ValueError(f"{self.name}: {len(self.measurements)} measurements, {len(self.seconds)} times, "
                             f"{len(self.labels)} labels")


Loaded = tuple[list[Dataset], dict[str, str]]  # datasets, and what was skipped -> why


def _csv_rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def _batch_prefill(batch: int, tokens: int) -> StepFeatures:
    """``batch`` prompts of ``tokens`` tokens in one step, nothing cached."""
    one = prefill_features(tokens)
    return StepFeatures(num_seqs=batch, num_batched_tokens=batch * tokens, num_prefill_seqs=batch,
                        num_prefill_tokens=batch * tokens, attention_pairs=batch * one.attention_pairs,
                        prefill_kv_tokens=batch * tokens, max_context_len=tokens)


def _token_bucket(t: int) -> str:
    return "<=64 tokens" if t <= 64 else "65-512 tokens" if t <= 512 else ">512 tokens"


def read_vidur(data_dir: Path, specs: Specs) -> Loaded:
    """``vidur/<gpu>/<model>/mlp.csv`` -> one dataset per (gpu, model, tp); only the linear operators."""
    out, skipped = [], {}
    for path in sorted((data_dir / "vidur").glob("*/*/mlp.csv")):
        gpu, model_dir = path.parent.parent.name, path.parent.name
        rows = _csv_rows(path)
        if rows[0]["use_gated_mlp"] != "True":
            skipped[str(path)] = "ungated MLP: not a Llama-family shape"
            continue
        r0 = rows[0]
        spec = ModelSpec(name=f"{model_dir}-1layer", num_layers=1, hidden_size=int(r0["n_embd"]),
                         num_heads=int(r0["n_head"]), num_kv_heads=int(r0["n_kv_head"]),
                         head_dim=int(r0["n_embd"]) // int(r0["n_head"]), intermediate_size=int(r0["n_expanded_embd"]),
                         vocab_size=int(r0["vocab_size"]), dtype="float16")
        hw = specs.hardware(gpu)
        for tp in sorted({int(r["num_tensor_parallel_workers"]) for r in rows}):
            sel = [r for r in rows if int(r["num_tensor_parallel_workers"]) == tp]
            tokens = [int(r["num_tokens"]) for r in sel]
            secs = [sum(float(r[f"time_stats.{op}.median"]) for op in VIDUR_LINEAR_OPS) * MS for r in sel]
            feats = [StepFeatures(num_seqs=1, num_batched_tokens=t, num_prefill_seqs=1, num_prefill_tokens=t)
                     for t in tokens]
            out.append(Dataset("vidur", f"vidur {model_dir} {gpu} tp{tp}", spec, hw, tp, feats, secs,
                               [_token_bucket(t) for t in tokens], ops=("linear",)))
    return out, skipped


SPLITWISE_MODELS = {"llama2-70b": "llama2_70b"}
SPLITWISE_HARDWARE = {"a100-80gb": "a100", "h100-80gb": "h100", "h100-80gb-pcap": "h100"}
# The one setup whose decode rows fix each node's host_kernel_s, as (hardware, tp): TP 8, where the device has the
# least to do, so its decode steps are the host's. DGX-A100 (AMD EPYC 7742 hosts) and DGX-H100 (Intel Xeon 8480C)
# have different CPUs; the power-capped H100 runs on the DGX-H100 host (and its decode rows are the H100's).
SPLITWISE_HOST_FITS = {"a100-80gb": ("a100-80gb", 8), "h100-80gb": ("h100-80gb", 8),
                       "h100-80gb-pcap": ("h100-80gb", 8)}
HOST_FIT_LABEL = "decode"


def _kv_fits(model: ModelSpec, hw: HardwareSpec, tp: int, batch: int, context: int) -> bool:
    """Whether ``batch`` sequences of ``context`` tokens fit in the KV memory vLLM leaves per device (its default
    0.9 of device memory, minus this device's share of the weights)."""
    budget = VLLM_MEMORY_FRACTION * hw.mem_bytes - ar.weight_bytes(model) / tp
    return batch <= ar.max_concurrent_seqs(model, budget, context, tp=tp)


def read_splitwise(data_dir: Path, specs: Specs) -> Loaded:
    """``splitwise-sim/perf_model.csv`` -> one dataset per (model, hardware, tp); two points per row.

    Rows whose batch cannot fit in KV memory (Llama-2-70B at TP-2 on 80 GB parts, 32+ sequences of 640 tokens)
    are skipped: vLLM cannot have run them as one batch, and their prompt times do not scale with the batch.
    """
    groups: dict[tuple[str, str, int], list[dict[str, str]]] = {}
    skipped = {}
    for r in _csv_rows(data_dir / "splitwise-sim" / "perf_model.csv"):
        if r["model"] not in SPLITWISE_MODELS:
            skipped[f"splitwise {r['model']}"] = "no Llama-family shape (BLOOM: ALiBi, ungated GeLU MLP)"
            continue
        groups.setdefault((r["model"], r["hardware"], int(r["tensor_parallel"])), []).append(r)
    out = []
    for (model, hardware, tp), rows in sorted(groups.items()):
        hw = specs.hardware(SPLITWISE_HARDWARE[hardware])
        hw = replace(hw, name=hardware) if hardware != hw.name else hw
        model_spec = specs.model(SPLITWISE_MODELS[model])
        feats, secs, labels = [], [], []
        for r in rows:
            p, b, n = int(r["prompt_size"]), int(r["batch_size"]), int(r["token_size"])
            if not _kv_fits(model_spec, hw, tp, b, p + n):
                key = f"splitwise {model} {hardware} tp{tp} batch {b}x{p}+{n}"
                skipped[key] = "batch exceeds KV memory (0.9 of device memory minus weights)"
                continue
            feats += [_batch_prefill(b, p), decode_features(b, p + n // 2)]
            secs += [float(r["prompt_time"]) * MS, float(r["token_time"]) * MS]
            labels += ["prefill", "decode"]
        network = data_dir / "vidur" / "network"
        out.append(Dataset("splitwise", f"splitwise {model} {hardware} tp{tp}", model_spec, hw, tp, feats, secs,
                           labels, network_dir=network if network.is_dir() else None))
    return out, skipped


def read_sarathi(data_dir: Path, specs: Specs) -> Loaded:
    """Sarathi-Serve figure 2 (prefill, decode) and figure 9 (chunked prefill) -> one dataset (Yi-34B, TP-2)."""
    d = data_dir / "sarathi-serve-osdi24"
    feats: list[Measurement] = []
    secs, labels, skipped = [], [], {}
    for kind in ("prefill", "decode"):
        for r in _csv_rows(d / "figure-2" / f"{kind}.csv"):
            if float(r["Batch Id"]) == 0:  # the engine's first batch (warm-up): 256 tokens slower than 512
                skipped[f"sarathi figure-2 {kind} {r['batch_num_tokens']} tokens"] = "first batch (Batch Id 0)"
                continue
            n = int(float(r["batch_num_tokens"]))
            feats.append(prefill_features(n) if kind == "prefill" else decode_features(n, SARATHI_DECODE_CONTEXT))
            secs.append(float(r["batch_execution_time"]))
            labels.append(kind)
    for r in _csv_rows(d / "figure-9" / "chunking-overhead.csv"):
        length, chunk = int(r["prefill_length"]), int(r["chunk_size"])
        feats.append(tuple(prefill_features(min(chunk, length - s), s) for s in range(0, length, chunk)))
        secs.append(float(r["prefill_execution_time"]) * MS)
        labels.append("chunked prefill" if chunk < length else "prefill")
    hw = replace(specs.hardware("a100"), name="a100-pcie", mem_bw=A100_PCIE_MEM_BW)
    return [Dataset("sarathi-serve", "sarathi-serve yi-34b-200k a100-pcie tp2", YI_34B_200K, hw, 2, feats, secs,
                    labels)], skipped


def _distserve_limits(data_dir: Path) -> dict[tuple[str, int], int]:
    """Profiling token limits; setups DistServe's script does not list fall back to max_num_tokens.csv (pp=1)."""
    limits = {(r["model"], int(r["tp"])): int(r["max_num_tokens"])
              for r in _csv_rows(data_dir / "distserve" / "max_num_tokens.csv") if r["pp"] == "1"}
    return {**limits, **DISTSERVE_TOKEN_LIMITS}


def read_distserve(data_dir: Path, specs: Specs) -> Loaded:
    """``distserve/profiler-a100-80g.{distserve,vllm}.json`` -> one dataset per (engine, model, tp), derived."""
    limits, out, skipped = _distserve_limits(data_dir), [], {}
    hw = specs.hardware("a100")
    for engine in ("distserve", "vllm"):
        profile = json.loads((data_dir / "distserve" / f"profiler-a100-80g.{engine}.json").read_text())
        for model, per_tp in profile.items():
            if model not in OPT_TWINS:
                skipped[f"distserve {engine} {model}"] = "no model shape"
                continue
            for tp_key, coef in per_tp.items():
                tp = int(tp_key)
                limit = limits.get((model, tp))
                if limit is None:
                    skipped[f"distserve {engine} {model} tp{tp}"] = "no token limit for the profiling grid"
                    continue
                feats, secs, labels = [], [], []
                pa, pb, pc = coef["prefill"]
                for b in DISTSERVE_BATCH_SIZES:
                    small = b <= coef["decoding_large_small_bs_threshold"]
                    da, db, dc = coef["decoding_smallbs" if small else "decoding_largebs"]
                    for n in DISTSERVE_INPUT_LENS:
                        if b * ((n + 15) // 16 * 16) > limit:
                            continue
                        for f, ms, label in ((_batch_prefill(b, n), pa + pb * b * n + pc * b * n * n, "prefill"),
                                             (decode_features(b, n + DISTSERVE_OUTPUT_LEN // 2),
                                              da + db * b * n + dc * b, "decode")):
                            if ms > 0:
                                feats.append(f)
                                secs.append(ms * MS)
                                labels.append(label)
                out.append(Dataset("distserve", f"distserve {model.split('/')[-1]} a100 tp{tp} ({engine} engine)",
                                   OPT_TWINS[model], hw, tp, feats, secs, labels, derived=True))
    return out, skipped


READERS: dict[str, Callable[[Path, Specs], Loaded]] = {"vidur": read_vidur, "splitwise": read_splitwise,
                                                       "sarathi-serve": read_sarathi, "distserve": read_distserve}


def load(source: str, specs: Specs, data_dir: str | Path | None = None) -> Loaded:
    if source not in READERS:
        raise ValueError(f"source={source!r}; allowed: {sorted(READERS)}")
    return READERS[source](Path(data_dir) if data_dir is not None else default_data_dir(), specs)


def _priced(roofline: RooflineCostModel, ds: Dataset):
    return roofline if ds.ops is None else OpGroupCost(roofline, ds.ops)


def default_roofline(ds: Dataset) -> RooflineCostModel:
    """``conf/cost_model/roofline.yaml``'s roofline for the setup: 0.7, 0.75, 1 ms, the preset's
    ``hardware.kernel_launch_s`` per kernel, no host term, the setup's measured collectives where it has them."""
    return RooflineCostModel(ds.model, ds.hardware, tp=ds.tp,
                             network_dir=None if ds.network_dir is None else str(ds.network_dir))


@dataclass(frozen=True)
class HostFit:
    """One host node's ``host_kernel_s``, fitted on the ``label`` rows of one setup (``fit_host``)."""

    setup: str  # the dataset name
    label: str
    rows: int
    host_kernel_s: float
    seen: tuple[str, ...] = ()  # setups whose ``label`` rows are the fit's own numbers (the fit setup among them)

    def held_out(self, ds: Dataset) -> np.ndarray:
        """Which of ``ds``'s rows the fit did not see (a copy of the fit rows counts as seen)."""
        return np.array([ds.name not in self.seen or lab != self.label for lab in ds.labels])

    def describe(self) -> str:
        copies = [n for n in self.seen if n != self.setup]
        return (f"host_kernel_s {1e6 * self.host_kernel_s:.1f} us, fitted on the {self.rows} {self.label} rows of "
                f"{self.setup}" + (f" (the same numbers as {', '.join(copies)}'s)" if copies else ""))


def fit_host(ds: Dataset, label: str = HOST_FIT_LABEL) -> HostFit:
    """``host_kernel_s`` of the default roofline fitted on ``ds``'s ``label`` rows (``sim.fit.fit_host_kernel_s``)."""
    rows = [i for i, lab in enumerate(ds.labels) if lab == label]
    h = fit_host_kernel_s(default_roofline(ds), [ds.measurements[i] for i in rows], ds.seconds[rows])
    return HostFit(ds.name, label, len(rows), h, (ds.name,))


def _label_rows(ds: Dataset, label: str) -> list[tuple[Measurement, float]]:
    return sorted(((m, float(t)) for m, t, lab in zip(ds.measurements, ds.seconds, ds.labels, strict=True)
                   if lab == label), key=repr)


def host_fits(datasets: list[Dataset]) -> dict[str, HostFit]:
    """Dataset name -> the host fit of its node (Splitwise: ``SPLITWISE_HOST_FITS``; other sources: none)."""
    by_key = {(ds.source, ds.hardware.name, ds.tp): ds for ds in datasets}
    fits: dict[tuple[str, int], HostFit] = {}
    out = {}
    for ds in datasets:
        key = SPLITWISE_HOST_FITS.get(ds.hardware.name) if ds.source == "splitwise" else None
        if key is None or ("splitwise", *key) not in by_key:
            continue
        if key not in fits:
            fit_ds = by_key["splitwise", *key]
            fit = fit_host(fit_ds)
            own = _label_rows(fit_ds, fit.label)  # the power-capped H100's decode rows are the H100's numbers
            copies = tuple(d.name for d in datasets if d is not fit_ds and _label_rows(d, fit.label) == own)
            fits[key] = replace(fit, seen=fit.seen + copies)
        out[ds.name] = fits[key]
    return out


def _medians(p: np.ndarray, y: np.ndarray, labels: list[str], rows: np.ndarray) -> dict[str, float | None]:
    """Median |relative error| of the ``rows`` (a mask): all, and by label (None: no row)."""
    rel = np.abs(p - y) / y
    lab = np.array(labels, dtype=object)
    out = {"all": float(np.median(rel[rows])) if rows.any() else None}
    for g in sorted(set(labels)):
        sel = rows & (lab == g)
        out[g] = float(np.median(rel[sel])) if sel.any() else None
    return out


def check_dataset(ds: Dataset, folds: int = 5, host: HostFit | None = None) -> dict[str, Any]:
    """Default roofline error, fitted roofline (+ held-out error) and, for whole steps, a fitted linear model;
    with ``host`` the default roofline plus that host term, its errors on all rows and on the held-out ones;
    ``points`` holds per-row measured and predicted seconds for plots.

    The default roofline is ``default_roofline``; for single-operator data its per-step overhead does not apply and
    is 0 (and the kernel launches are not in the timed op groups). The peak bound has no overhead, no launches and
    the link's collectives.
    """
    F, y = ds.measurements, ds.seconds
    default = default_roofline(ds)
    peak = _priced(default.replace(compute_eff=1.0, bw_eff=1.0, overhead_s=0.0, kernel_s=0.0, network_dir=None), ds)
    if ds.ops is not None:
        default = default.replace(overhead_s=0.0)
    fitted, fit_rep = fit_roofline(F, y, ds.model, ds.hardware, {"tp": ds.tp}, labels=ds.labels, ops=ds.ops)
    cv = cross_validate(lambda f, t: _priced(fit_roofline(f, t, ds.model, ds.hardware, {"tp": ds.tp},
                                                          ops=ds.ops)[0], ds), F, y, folds)
    out: dict[str, Any] = {
        "source": ds.source, "name": ds.name, "model": ds.model.name, "hardware": ds.hardware.name, "tp": ds.tp,
        "rows": len(y), "ops": list(ds.ops) if ds.ops else None, "derived": ds.derived,
        "faster_than_peak": int((predict(peak, F) > y).sum()),  # below the 100%-efficiency, zero-overhead bound
        "default": report(_priced(default, ds), F, y, ds.labels).to_dict(),
        "roofline": {**{k: fitted.params()[k] for k in FITTED_ROOFLINE},
                     "report": fit_rep.to_dict(), "cv_median_rel_error": float(np.median(np.abs(cv)))},
        "linear": None,
        "host": None,
    }
    if host is not None:
        p = predict(_priced(default.replace(host_kernel_s=host.host_kernel_s), ds), F)
        held = host.held_out(ds)
        out["host"] = {"host_kernel_s": host.host_kernel_s, "fitted_on": host.setup, "label": host.label,
                       "fit": host.describe(), "held_out_rows": int(held.sum()),
                       "median": _medians(p, y, ds.labels, np.ones(len(y), bool)),
                       "held_out_median": _medians(p, y, ds.labels, held)}
    if ds.ops is None:
        lin, lin_rep = fit_linear(F, y, labels=ds.labels)
        lcv = cross_validate(lambda f, t: fit_linear(f, t)[0], F, y, folds)
        out["linear"] = {"coefficients": lin.to_dict(), "report": lin_rep.to_dict(),
                         "cv_median_rel_error": float(np.median(np.abs(lcv)))}
    out["points"] = {"measured": y.tolist(), "default": [float(v) for v in predict(_priced(default, ds), F)],
                     "fitted": [float(v) for v in predict(_priced(fitted, ds), F)], "labels": list(ds.labels)}
    if host is not None:
        out["points"]["host"] = [float(v) for v in p]
    return out


def check(source: str, specs: Specs, data_dir: str | Path | None = None, folds: int = 5) -> dict[str, Any]:
    """Every setup of one source: ``check_dataset`` results (with its node's host fit, ``host_fits``), which rows
    were skipped and why, the host fits, and a summary pooling all rows of the source (each setup priced by its own
    fitted roofline; the host term's pooled error over the setups that have one)."""
    datasets, skipped = load(source, specs, data_dir)
    hosts = host_fits(datasets)
    setups = [check_dataset(ds, folds, hosts.get(ds.name)) for ds in datasets]
    meas = np.concatenate([x["points"]["measured"] for x in setups])

    def pooled(key: str) -> float:
        pred = np.concatenate([x["points"][key] for x in setups])
        return float(np.median(np.abs(pred - meas) / meas))

    summary = {"setups": len(setups), "rows": len(meas), "default_median_rel_error": pooled("default"),
               "fitted_median_rel_error": pooled("fitted"), "host_median_rel_error": None}
    if hosts:
        with_host = [x for x in setups if x["host"] is not None]
        m = np.concatenate([x["points"]["measured"] for x in with_host])
        p = np.concatenate([x["points"]["host"] for x in with_host])
        summary["host_median_rel_error"] = float(np.median(np.abs(p - m) / m))
    fits = sorted({h.describe() for h in hosts.values()})
    return {"source": source, "skipped": skipped, "summary": summary, "host_fits": fits, "setups": setups}
