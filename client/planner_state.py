"""What `--budget auto`'s planner learned, kept on disk for the next process on the same pair.

A planner starts knowing nothing of the pair but its forward-time curves: each request then tries
trees for its first steps, and the running means (rate, calibration, the nodes' observed over
modelled times) settle over about 20 steps. A long-lived gateway pays that once. A one-shot
`specexec generate` paid it on every call: on a CPU where the pair's trees never pay, the trial
alone cost a 64-token request about a tenth of its speed (docs/planner.md). The state is keyed by
everything it was learned on: both nodes' models, dtypes, devices and forward-time curves (which
change with the hardware, the build and the thread count), the tree cap and whether the draft runs
apart; any change starts afresh.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from client.budget import BudgetPlanner
from common.decoding.tree import TreeParams
from common.decoding.types import NodeInfo
from common.model.store import cache_root, read_json, write_json

log = logging.getLogger("specexec.planner")

STATE_VERSION = 4  # 2: a regime keeps the time its trees imposed on shared passes; 3: means per load class; 4: the share of a re-rooted tree the search had done


def default_dir() -> Path:
    return cache_root() / "planner"


def state_path(directory: Path, target: NodeInfo, draft: NodeInfo, base: TreeParams, apart: bool) -> Path:
    """The file for this pair as it runs now."""
    nodes = [
        [i.model_id, i.dtype, i.device, i.vocab_size, [list(p) for p in i.forward_curve]] for i in (target, draft)
    ]
    key = json.dumps([STATE_VERSION, nodes, repr(base), apart])
    return directory / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"


def load(planner: BudgetPlanner, path: Path) -> bool:
    """Restore what an earlier process learned on this pair; False (and the planner as it was) if
    there is nothing usable: no file, a torn one, or one that is not a planner's state (a warning
    names it)."""
    data: Any = read_json(path)
    if data is None:
        return False
    try:
        planner.restore(data)
    except (TypeError, ValueError, KeyError) as exc:
        log.warning("ignoring the planner state in %s (%s); starting afresh", path, exc)
        return False
    log.info("--budget auto goes on from what earlier runs learned on this pair (%s)", path)
    return True


def save(planner: BudgetPlanner, path: Path) -> None:
    """Keep the planner's state; a cache that cannot be written costs only the next process's warm
    start, so it is reported and generation goes on."""
    try:
        write_json(path, planner.snapshot())
    except OSError as exc:
        log.warning("could not keep the planner state in %s (%s)", path, exc)
