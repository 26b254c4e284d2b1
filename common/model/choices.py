"""The torch backend's settings as a command line gives them: plain values, free of torch, so that
a node on llama.cpp parses its options without loading it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_BUCKETS = (1, 4, 8, 16, 32, 64)
MAX_BUCKET = 4096


def parse_buckets(text: str | Sequence[int]) -> tuple[int, ...]:
    """Buckets from "1,4,8" or a sequence; each must be in [1, MAX_BUCKET]."""
    items = text.split(",") if isinstance(text, str) else list(text)
    try:
        buckets = sorted({int(b) for b in items if str(b).strip()})
    except ValueError as e:
        raise ValueError(f"compile buckets must be integers separated by commas, got {text!r}") from e
    if not buckets or buckets[0] < 1 or buckets[-1] > MAX_BUCKET:
        raise ValueError(f"compile buckets must be in [1, {MAX_BUCKET}], got {text!r}")
    return tuple(buckets)


QUANTIZE_CHOICES = ("none", "int8", "int4")


def draft_dtype(dtype: str, scheme: str) -> str:
    """The float dtype an int8 or int4 draft runs its norms and activations in when the user asked for
    `dtype` for both models: float32, its fastest on a CPU (no conversions around each int8 product)."""
    return dtype if scheme == "none" else "float32"


@dataclass(frozen=True)
class OffloadPlan:
    """How to split the target between device and host: `--offload`, `--resident-layers`, `--prefetch-layers`."""

    resident_layers: int = 0
    prefetch_layers: int = 2
