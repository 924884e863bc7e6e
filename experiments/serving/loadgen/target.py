"""The ``target`` section of a load test: where and how requests are sent."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf

PROMPT_MODES = ("tokens", "text")


@dataclass(frozen=True)
class Target:
    """The ``target`` section: where and how requests are sent."""

    url: str
    model: str | None = None
    timeout_s: float | None = None
    prompt_mode: str = "tokens"
    tokenizer: str | None = None
    ignore_eos: bool = True
    max_concurrency: int | None = None
    api_key: str | None = None
    max_failed_share: float = 0.5  # more of the requests than this failed (rejected, timed out): the run failed
    extra_body: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.url, str) or not self.url.startswith(("http://", "https://")):
            raise ValueError(f"target.url must be an http:// or https:// URL, got {self.url!r}")
        if self.prompt_mode not in PROMPT_MODES:
            raise ValueError(f"target.prompt_mode={self.prompt_mode!r}; allowed: {list(PROMPT_MODES)}")
        t = self.timeout_s
        if t is not None and (isinstance(t, bool) or not isinstance(t, int | float) or not t > 0):
            raise ValueError(f"target.timeout_s must be a number of seconds > 0 or null, got {t!r}")
        c = self.max_concurrency
        if c is not None and (isinstance(c, bool) or not isinstance(c, int) or c < 1):
            raise ValueError(f"target.max_concurrency must be an int >= 1 or null, got {c!r}")
        f = self.max_failed_share
        if isinstance(f, bool) or not isinstance(f, int | float) or not 0 <= f <= 1:
            raise ValueError(f"target.max_failed_share must be a number in [0, 1], got {f!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"target.ignore_eos must be true or false, got {self.ignore_eos!r}")
        if not isinstance(self.extra_body, Mapping):
            raise ValueError(f"target.extra_body must be a mapping of extra request fields, got {self.extra_body!r}")

    @classmethod
    def from_mapping(cls, node: Mapping[str, Any]) -> Target:
        d = dict(OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else node)
        allowed = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(d) - allowed)
        if unknown:
            raise ValueError(f"target: unknown keys {unknown}; allowed: {sorted(allowed)}")
        if "url" not in d:
            raise ValueError("target.url is required (e.g. target.url=http://127.0.0.1:8000)")
        d["extra_body"] = dict(d.get("extra_body") or {})
        return cls(**d)

    @property
    def completions_url(self) -> str:
        """``url`` as given when it ends with /v1/completions, else with /v1/completions (or /completions) added."""
        u = self.url.rstrip("/")
        if u.endswith("/completions"):
            return u
        return u + ("/completions" if u.endswith("/v1") else "/v1/completions")

    @property
    def models_url(self) -> str:
        return self.completions_url.removesuffix("/completions") + "/models"

