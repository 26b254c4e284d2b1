"""`--budget auto`'s planner keeps what it learned on a pair for the next process on that pair."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from client import planner_state
from client.api import SpecExec
from client.budget import PRIOR_STEPS, TRIALS_DECLINED, BudgetPlanner
from common.decoding.sampling import SamplingParams
from common.decoding.types import NodeInfo
from draft_node.engine import DraftEngine
from target_node.engine import TargetEngine
from tests.test_budget import BASE, CPU, DRAFT, run_request
from tests.test_exactness import PROMPT

ROOT = Path(__file__).resolve().parents[1]


def info(role: str, curve: list[tuple[int, float]], model: str = "m") -> NodeInfo:
    return NodeInfo(role=role, model_id=model, vocab_size=100, tokenizer_fingerprint="t", eos_token_ids=(0,),
                    max_context=256, max_tree_nodes=64, max_tree_depth=32, dtype="float32", device="cpu",
                    forward_curve=tuple(curve))  # fmt: skip


def test_a_planner_that_learned_trees_do_not_pay_hands_it_to_the_next_one(tmp_path):
    """A fresh process on a pair whose trees never pay would try them again for every request's
    first steps; with the state kept, its first request starts on the target alone."""
    path = planner_state.state_path(tmp_path, info("target", CPU), info("draft", DRAFT), BASE, apart=False)
    taught = BudgetPlanner(CPU, DRAFT, base=BASE)
    for _ in range(TRIALS_DECLINED):
        run_request(taught, 40, accepted=0, seconds=0.4)
    planner_state.save(taught, path)

    fresh, restored = BudgetPlanner(CPU, DRAFT, base=BASE), BudgetPlanner(CPU, DRAFT, base=BASE)
    assert planner_state.load(restored, path)
    assert all(run_request(fresh, PRIOR_STEPS, accepted=0, seconds=0.4))
    assert not any(run_request(restored, PRIOR_STEPS, accepted=0, seconds=0.4))
    assert restored.snapshot()["target_scale"] == pytest.approx(taught.snapshot()["target_scale"])


def test_numpy_numbers_in_the_means_are_kept_as_plain_ones(tmp_path):
    plan = BudgetPlanner(CPU, DRAFT, base=BASE)
    run_request(plan, 8, accepted=3, seconds=0.2)
    with plan._lock:
        stats = plan._stats("greedy")
        stats.batch, stats.steps, stats.judged = np.float32(2.5), np.int64(9), np.bool_(True)
    planner_state.save(plan, tmp_path / "state.json")
    restored = BudgetPlanner(CPU, DRAFT, base=BASE)
    assert planner_state.load(restored, tmp_path / "state.json")
    assert restored.stats().batch == 2.5 and restored.stats().steps == 9 and restored.stats().judged is True


def test_the_state_belongs_to_the_pair_as_it_runs():
    """Another model, another forward-time curve (another machine, build or thread count), another
    tree cap or a draft moved to its own machine: another file."""
    target, draft = info("target", CPU), info("draft", DRAFT)
    key = planner_state.state_path(Path("/s"), target, draft, BASE, apart=True)
    others = [
        (info("target", CPU, model="other"), draft, BASE, True),
        (info("target", [(n, 2 * t) for n, t in CPU]), draft, BASE, True),
        (target, info("draft", DRAFT[:2]), BASE, True),
        (target, draft, replace(BASE, budget=64), True),
        (target, draft, BASE, False),
    ]
    assert planner_state.state_path(Path("/s"), target, draft, BASE, apart=True) == key
    assert all(planner_state.state_path(Path("/s"), *other) != key for other in others)


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        "[]",
        '{"draft_scale": 1.0}',
        '{"draft_scale": -1.0, "target_scale": 1.0, "regimes": {}}',
        '{"draft_scale": 1.0, "target_scale": 1.0, "regimes": {"greedy": {"tokens": 1.0}}}',
        '{"draft_scale": 1.0, "target_scale": 1.0, "regimes": {"beam": {}}}',
    ],
)
def test_a_state_file_that_is_not_one_is_ignored(tmp_path, caplog, content):
    path = tmp_path / "state.json"
    path.write_text(content)
    plan = BudgetPlanner(CPU, DRAFT, base=BASE)
    before = plan.snapshot()
    with caplog.at_level(logging.WARNING, logger="specexec.planner"):
        assert not planner_state.load(plan, path)
    assert plan.snapshot() == before
    assert content == "{not json" or str(path) in caplog.text


def test_a_regime_holding_nonsense_is_refused(tmp_path):
    plan = BudgetPlanner(CPU, DRAFT, base=BASE)
    run_request(plan, 8, accepted=3, seconds=0.2)
    state = plan.snapshot()
    for field, value in (("seconds", 0.0), ("accepted", float("nan")), ("declined", "3"), ("steps", -1)):
        bad = json.loads(json.dumps(state))
        bad["regimes"]["greedy"][field] = value
        with pytest.raises(ValueError):
            BudgetPlanner(CPU, DRAFT, base=BASE).restore(bad)


def test_each_load_classs_means_are_kept_and_checked(tmp_path):
    plan = BudgetPlanner(CPU, DRAFT, base=BASE)
    run_request(plan, 8, accepted=3, seconds=0.2)
    for _ in range(8):
        plan.observe_sharing(8)
    run_request(plan, 8, accepted=0, seconds=0.4)
    state = plan.snapshot()
    assert {"greedy", "greedy@8"} <= set(state["regimes"]) and state["regimes"]["greedy@8"]["load"] == 8
    planner_state.save(plan, tmp_path / "state.json")
    restored = BudgetPlanner(CPU, DRAFT, base=BASE)
    assert planner_state.load(restored, tmp_path / "state.json") and restored.snapshot() == state
    for name, load in (("greedy@8", 4), ("greedy@3", 3)):
        bad = json.loads(json.dumps(state))
        bad["regimes"][name] = {**state["regimes"]["greedy@8"], "load": load}
        with pytest.raises(ValueError):
            BudgetPlanner(CPU, DRAFT, base=BASE).restore(bad)


def generator(loaded, directory: Path | None) -> SpecExec:
    target = TargetEngine(loaded["target"], max_context=256, max_tree=64)
    draft = DraftEngine(loaded["truncated"], max_context=256, max_tree=64)
    target.forward_curve = ((1, 0.01), (65, 0.02))
    draft.forward_curve = ((1, 0.001), (64, 0.002))
    return SpecExec(target, draft, loaded["target"].tokenizer, auto_budget=True, planner_dir=directory)


def test_each_request_keeps_the_state_for_the_next_generator(loaded, tmp_path):
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    first = generator(loaded, tmp_path)
    first.generate(PROMPT, params)
    learned = first.planner.snapshot()
    assert learned["regimes"]["greedy"]["steps"] > 0
    assert not first.planner_restored
    second = generator(loaded, tmp_path)
    assert second.planner_restored and second.planner.snapshot() == learned
    assert second.planner_file == first.planner_file and second.planner_file.parent == tmp_path
    alone = generator(loaded, None)
    assert alone.planner.snapshot()["regimes"] == {} and alone.planner_file is None


def test_the_cli_keeps_the_state_unless_told_not_to(model_dirs, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "SPECEXEC_NO_PLANNER_MEMORY"}
    env.update(PYTHONPATH=str(ROOT), SPECEXEC_HOME=str(tmp_path / "home"))
    command = [sys.executable, "-m", "client.cli.main", "generate", "--target-model", str(model_dirs["target"]),
               "--draft-model", str(model_dirs["truncated"]), "--prompt", "hello", "--max-new-tokens", "6",
               "--max-budget", "16"]  # fmt: skip
    kept = tmp_path / "home" / "planner"
    off = {**env, "SPECEXEC_NO_PLANNER_MEMORY": "1"}  # --no-planner-memory, as the tests' conftest sets it
    subprocess.run(command, env=off, check=True, capture_output=True, timeout=300)
    assert not kept.exists()
    subprocess.run(command, env=env, check=True, capture_output=True, timeout=300)
    assert len(list(kept.glob("*.json"))) == 1
