"""The gateway's queue for the target's sessions (client.admission): no more than `slots` run, the
rest wait first come first served, past `max_waiting` a request is refused, and a place or slot
given up passes on."""

from __future__ import annotations

import threading
import time

import pytest

from client.admission import Admission, QueueFull
from common.ops.metrics import REQUESTS_WAITING


def test_slots_then_queue_then_refusal():
    admission = Admission(2, max_waiting=1)
    woken: list[str] = []
    a, b = admission.enter(lambda: woken.append("a")), admission.enter(lambda: woken.append("b"))
    assert a.admitted and b.admitted and admission.running == 2
    c = admission.enter(lambda: woken.append("c"))
    assert not c.admitted and admission.waiting == 1
    with pytest.raises(QueueFull, match=r"--max-sessions is 2\) and 1 wait \(--max-queue is 1\)"):
        admission.enter(lambda: None)
    admission.leave(b)
    assert c.admitted and woken == ["c"] and admission.running == 2 and admission.waiting == 0
    admission.leave(b)  # twice: nothing more is freed
    assert admission.running == 2
    admission.leave(a)
    admission.leave(c)
    assert admission.running == 0 and woken == ["c"]


def test_first_come_first_served_and_a_place_given_up_passes_on():
    admission = Admission(1, max_waiting=8)
    woken: list[int] = []
    holder = admission.enter(lambda: None)
    tickets = [admission.enter(lambda i=i: woken.append(i)) for i in range(4)]
    admission.leave(tickets[1])  # its client left while it waited
    assert admission.waiting == 3
    for expected in (0, 2, 3):
        admission.leave(holder)
        holder = tickets[expected]
        assert woken[-1] == expected and holder.admitted
    assert woken == [0, 2, 3] and not tickets[1].admitted


def test_a_new_request_does_not_overtake_the_queue():
    admission = Admission(1, max_waiting=2)
    holder = admission.enter(lambda: None)
    first = admission.enter(lambda: None)
    admission.leave(holder)
    assert first.admitted
    late = admission.enter(lambda: None)
    assert not late.admitted


def test_wait_gives_up_its_place_when_cancelled():
    admission = Admission(1, max_waiting=1)
    holder = admission.enter(lambda: None)
    waiting_before = REQUESTS_WAITING._value.get()
    gone = threading.Event()
    result: list[object] = []
    thread = threading.Thread(target=lambda: result.append(admission.wait(gone.is_set, poll=0.01)))
    thread.start()
    deadline = time.monotonic() + 10
    while admission.waiting == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert admission.waiting == 1 and REQUESTS_WAITING._value.get() == waiting_before + 1
    gone.set()
    thread.join(10)
    assert result == [None] and admission.waiting == 0 and REQUESTS_WAITING._value.get() == waiting_before
    admission.leave(holder)
    assert admission.running == 0


def test_threads_never_run_more_than_the_slots():
    admission = Admission(3, max_waiting=64)
    lock, running, peak, done = threading.Lock(), [0], [0], []

    def job() -> None:
        ticket = admission.wait(lambda: False, poll=0.005)
        assert ticket is not None
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.002)
        with lock:
            running[0] -= 1
        admission.leave(ticket)
        done.append(1)

    threads = [threading.Thread(target=job) for _ in range(40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(done) == 40 and peak[0] <= 3 and admission.running == 0 and admission.waiting == 0


def test_a_request_borrows_only_slots_no_one_waits_for():
    """A request's several prompts run at once on free slots, never ahead of a queued request."""
    admission = Admission(slots=4, max_waiting=4)
    first = admission.enter(lambda: None)
    lent = admission.borrow(8)
    assert len(lent) == 3 and admission.running == 4 and all(t.admitted for t in lent)
    queued = admission.enter(lambda: None)
    assert not queued.admitted and admission.borrow(1) == []
    admission.leave(lent[0])  # a returned slot goes to the queue first
    assert queued.admitted and admission.borrow(2) == []
    for ticket in [*lent[1:], first, queued]:
        admission.leave(ticket)
    assert admission.running == 0 and len(admission.borrow(0)) == 0


@pytest.mark.parametrize("slots, waiting, field", [(0, 1, "slots"), (1, -1, "--max-queue")])
def test_bad_limits_are_refused(slots, waiting, field):
    with pytest.raises(ValueError, match=field):
        Admission(slots, waiting)


def test_the_grpc_gateway_queues_refuses_and_drops_a_cancelled_call(loaded):
    """Through a real gRPC server: with the one slot taken, a Generate call waits; the next, with the
    queue full too, is RESOURCE_EXHAUSTED; a waiting call its client cancels leaves the line; and the
    one that waited is answered in full once the slot frees."""
    import grpc

    from client.api import SpecExec
    from client.gateway import GenerationServicer
    from common.decoding.sampling import SamplingParams
    from common.decoding.tree import TreeParams
    from common.pb.specexec.v1 import specexec_pb2 as pb
    from common.pb.specexec.v1 import specexec_pb2_grpc as pb_grpc
    from common.rpc.server import Server
    from draft_node.engine import DraftEngine
    from target_node.engine import TargetEngine

    target = TargetEngine(loaded["target"], max_context=256, max_tree=8)
    draft = DraftEngine(loaded["truncated"], max_context=256, max_tree=8)
    gen = SpecExec(target, draft, loaded["target"].tokenizer, tree=TreeParams(budget=8))
    admission = Admission(1, max_waiting=1)
    servicer = GenerationServicer(lambda mode, tree: gen, gen, admission)
    server = Server("127.0.0.1:0", [(pb_grpc.add_GenerationServiceServicer_to_server, servicer, "g")]).start()
    request = pb.GenerateRequest(text="Hello, ", sampling=pb.SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True))
    holder = admission.enter(lambda: None)  # the slot, taken as a running generation would
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = pb_grpc.GenerationServiceStub(channel)
            cancelled = stub.Generate(request, timeout=60)
            wait_for(lambda: admission.waiting == 1)
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(request, timeout=60))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-queue is 1" in err.value.details()
            assert ("grpc-retry-pushback-ms", "1000") in err.value.trailing_metadata()
            cancelled.cancel()
            wait_for(lambda: admission.waiting == 0)
            assert admission.running == 1
            waiting = stub.Generate(request, timeout=60)
            wait_for(lambda: admission.waiting == 1)
            admission.leave(holder)
            text = "".join(r.chunk.text for r in waiting if r.HasField("chunk"))
            want = gen.generate("Hello, ", SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)).text
            assert text == want
            wait_for(lambda: admission.running == 0)
            assert len(target.sessions) == 0 and len(draft.sessions) == 0
    finally:
        server.stop(0)


def wait_for(condition, within: float = 30.0) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, "the condition did not hold in time"
        time.sleep(0.02)
