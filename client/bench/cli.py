"""`specexec bench`."""

from client.bench.harness import add_bench_parser

__all__ = ["add_bench_parser"]
