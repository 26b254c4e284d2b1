"""What the client commands print: streamed text, and a summary on stderr."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from typing import Any

from client.api import collect


def print_stream(chunks: Iterator[Any], as_json: bool) -> int:
    """Stream text to stdout and a summary to stderr, or print one JSON object."""

    if as_json:
        print(json.dumps(collect(chunks).as_dict()))
        return 0
    for chunk in chunks:
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
        if chunk.stats is not None:
            s = chunk.stats
            print(
                f"\n[{s.new_tokens} tokens in {s.wall_seconds:.1f} s: {s.tokens_per_second:.2f} tok/s, "
                f"{s.tokens_per_step:.2f} tokens per target step, finish: {chunk.finish_reason}]",
                file=sys.stderr,
            )
    return 0
