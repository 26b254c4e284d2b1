"""benchmarks/planner_sim.py judges planner changes; it must decode what it claims to."""

from __future__ import annotations

import random

from benchmarks import planner_sim as sim
from tests.helpers import ROOT


def test_every_contestant_decodes_each_whole_reply_and_no_more():
    timing = sim.curves(ROOT / "docs" / "forward.json", "repacked", "int8")
    results = sim.simulate(seeds=1, requests=1, new_tokens=40, timing=timing)
    assert {name for name, _ in results} == set(sim.CONTESTANTS)
    for (name, _), tallies in results.items():
        for tally in tallies:
            assert tally.tokens == 40 and tally.seconds > 0
            if name == "chain k=2":
                assert tally.steps >= 40 / 3


def test_the_reply_is_never_guessed_on_its_opening_step():
    for category in sim.CATEGORIES:
        text = sim.reply(random.Random(0), category, 64)
        assert text.tokens[0] == sim.MISS and len(text.tokens) == len(text.confidence) == 64
