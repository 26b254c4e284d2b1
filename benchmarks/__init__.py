"""One-off experiments that judge changes: forward and step timings, the planner's simulation and
constants, the draft's calibration. Run from the repository root as `python -m benchmarks.<name>`;
not part of the installed package (pyproject's package list leaves it out)."""
