"""The ``gateway`` config section, parsed once into frozen records (every bad key is a one-line error naming it)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from omegaconf import DictConfig, OmegaConf

from core.checks import check_float, check_int


@dataclass(frozen=True)
class BackendSpec:
    """One backend: an OpenAI-compatible server at ``url``."""

    url: str
    name: str = ""  # its label in /metrics and requests.csv; "" -> b<index>
    block_size: int = 16  # its KV block size (vLLM's and ours default to 16); vLLM's cache_config_info overrides
    num_blocks: int | None = None  # its KV pool in blocks; None: vLLM's cache_config_info, else index.max_blocks
    max_in_flight: int = 256  # requests in flight through the gateway beyond which the backend is saturated
    tokenizer: str | None = None  # a local tokenizer directory for text prompts; None: gateway.tokenizer

    def __post_init__(self) -> None:
        if not isinstance(self.url, str) or not self.url.startswith(("http://", "https://")):
            raise ValueError(f"gateway.backends: url must be an http:// or https:// URL, got {self.url!r}")
        check_int(self.block_size, "gateway.backends.block_size", 1)
        check_int(self.max_in_flight, "gateway.backends.max_in_flight", 1)
        if self.num_blocks is not None:
            check_int(self.num_blocks, "gateway.backends.num_blocks", 1)


@dataclass(frozen=True)
class GatewayConfig:
    backends: tuple[BackendSpec, ...]
    host: str = "127.0.0.1"
    port: int = 8100
    model_name: str | None = None  # the id /v1/models lists; None: the first backend's
    tokenizer: str | None = None  # default tokenizer directory of every backend (None: the character proxy)
    poll_interval_s: float = 1.0  # health check + /metrics scrape of every backend this often
    connect_timeout_s: float = 5.0  # a backend that accepts no connection this long counts as refusing
    timeout_s: float = 60.0  # no answer header / no stream chunk from a backend this long: the request ends (504)
    saturated_s: float = 1.0  # a backend that answered 429 takes no new request this long
    index_max_blocks: int = 100_000  # prefix index capacity per backend (blocks) when its pool size is unknown
    index_max_age_s: float = 600.0  # a block sent this long ago is taken as evicted by the backend
    flush_interval_s: float = 10.0  # write a snapshot of the run files this often
    drain_timeout_s: float = 10.0  # at shutdown, let in-flight requests finish this long

    def __post_init__(self) -> None:
        if not self.backends:
            raise ValueError("gateway.backends is empty: list at least one backend, e.g. "
                             "gateway.backends='[{url:\"http://127.0.0.1:8000\"}]'")
        names = [b.name for b in self.backends]
        if len(set(names)) != len(names):
            raise ValueError(f"gateway.backends: names must be unique, got {names}")
        check_int(self.port, "gateway.port", 0)
        check_int(self.index_max_blocks, "gateway.index_max_blocks", 1)
        for key in ("poll_interval_s", "connect_timeout_s", "timeout_s", "saturated_s", "index_max_age_s",
                    "flush_interval_s", "drain_timeout_s"):
            check_float(getattr(self, key), f"gateway.{key}", 0.0, strict=True)

    @classmethod
    def from_config(cls, node: DictConfig | Mapping[str, Any]) -> GatewayConfig:
        d = dict(OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else node)
        allowed = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - allowed)
        if unknown:
            raise ValueError(f"gateway: unknown keys {unknown}; allowed: {sorted(allowed)}")
        d["backends"] = tuple(_backend(b, i) for i, b in enumerate(d.get("backends") or ()))
        return cls(**d)


def _backend(entry: Any, index: int) -> BackendSpec:
    """A backend entry: a URL string or a mapping of ``BackendSpec`` fields."""
    if isinstance(entry, str):
        entry = {"url": entry}
    if not isinstance(entry, Mapping):
        raise ValueError(f"gateway.backends[{index}] must be a URL or a mapping with url, got {entry!r}")
    allowed = {f.name for f in fields(BackendSpec)}
    unknown = sorted(set(entry) - allowed)
    if unknown:
        raise ValueError(f"gateway.backends[{index}]: unknown keys {unknown}; allowed: {sorted(allowed)}")
    if "url" not in entry:
        raise ValueError(f"gateway.backends[{index}]: url is required")
    entry = dict(entry)
    entry["url"] = str(entry["url"]).rstrip("/")
    entry["name"] = entry.get("name") or f"b{index}"
    return BackendSpec(**entry)
