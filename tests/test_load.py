"""Eight clients at once against one draft node and one target node: every output equals its solo
run, the session cap holds (RESOURCE_EXHAUSTED beyond it) and every session is freed afterwards."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from client.remote import NodeError, RemoteTarget, connect, wait_until_serving
from common.decoding.sampling import SamplingParams
from common.decoding.tree import TreeParams
from common.runtime.sessions import TooManySessions
from tests.helpers import free_port, reference_decode

ROOT = Path(__file__).resolve().parents[1]
CLIENTS = 8


@pytest.fixture(scope="module")
def nodes(model_dirs):
    addrs, procs = {}, []
    for role, model in (("target", model_dirs["target"]), ("draft", model_dirs["truncated"])):
        addrs[role] = f"127.0.0.1:{free_port()}"
        cmd = [sys.executable, "-m", f"{role}_node", "--model", str(model), "--listen", addrs[role],
               "--max-sessions", str(CLIENTS), "--max-tree", "16", "--no-profile"]  # fmt: skip
        procs.append(subprocess.Popen(cmd, env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT))
    for proc, addr in zip(procs, addrs.values(), strict=True):
        wait_until_serving(addr, timeout=120, alive=lambda p=proc: p.poll() is None)
    yield addrs
    for proc in procs:
        proc.terminate()
        proc.wait(timeout=30)


def job(i: int) -> tuple[list[int], SamplingParams]:
    return [72, 101 + i, 108, 108, 111, 44, 32], SamplingParams(
        temperature=0.0 if i % 2 else 0.9, top_p=0.95, seed=100 + i, max_new_tokens=24, ignore_eos=True
    )


def test_concurrent_clients_get_their_solo_outputs(nodes, model_dirs):
    expected = [reference_decode(model_dirs["target"], *job(i)) for i in range(CLIENTS)]

    def client(i: int) -> list[int]:
        gen = connect(nodes["draft"], nodes["target"], tree=TreeParams(budget=16, max_depth=8))
        return gen.generate(*job(i)).token_ids

    with ThreadPoolExecutor(CLIENTS) as pool:
        got = list(pool.map(client, range(CLIENTS)))
    assert got == expected
    assert RemoteTarget(nodes["target"]).info() is not None


def test_sessions_beyond_the_cap_are_refused_and_all_are_freed(nodes):
    target = RemoteTarget(nodes["target"])
    sessions = [target.open_session([1, 2, 3]) for _ in range(CLIENTS)]
    with pytest.raises(TooManySessions, match=f"the limit is {CLIENTS}") as err:
        target.open_session([1, 2, 3])
    assert isinstance(err.value.__cause__, NodeError) and err.value.__cause__.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    for sid in sessions:
        assert target.close_session(sid)
    from common.pb.specexec.v1 import specexec_pb2 as pb

    assert target.stub.Info(pb.InfoRequest(), metadata=target.metadata).open_sessions == 0
