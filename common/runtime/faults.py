"""Node faults the decode loop survives, kept free of transport details. Here, below the client,
because a node raises one too: an in-process session the table evicted (`SessionNotFound`)."""

from __future__ import annotations


class NodeFault(Exception):
    """A node could not serve a step; the sequence can be replayed on a fresh session."""


class NodeRefused(Exception):
    """A node answered and refused the request (a tree over its limit, a bad argument): unlike a
    `NodeFault`, retrying cannot help, so the CLI reports it in one line."""


class NodeUnavailable(NodeFault, ConnectionError):
    """Unreachable, restarting, or past its deadline."""

    def __init__(self, message: str, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


class SessionLost(NodeFault):
    """The node no longer knows the session (it restarted, or the session expired while idle or made room for another)."""


class NodeChanged(NodeFault, ConnectionError):
    """The node answers, but as another model than the one this client checked (it restarted with
    another --model): its tokens would be another model's text. A draft then counts as down until it
    is checked again; a target's session is not replayed onto it."""
