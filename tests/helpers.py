"""Independent references for exactness tests: they share no cache, tree or session code with the engine."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from client.bench.harness import free_port  # also used by the tests
from common.decoding.sampling import SamplingParams, sample_rows
from common.decoding.tree import TokenTree, TreeStructure
from common.model.transformer import attention_bias


def reference_decode(
    model_dir, prompt: list[int], params: SamplingParams, eos: tuple[int, ...] = ()
) -> list[int]:
    """Target alone, no KV cache: recompute the whole sequence with Hugging Face at every step."""
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    seq = list(prompt)
    out: list[int] = []
    with torch.no_grad():
        for _ in range(params.max_new_tokens):
            logits = hf(torch.tensor([seq])).logits[0, -1:].float()
            token = int(sample_rows(logits.numpy(), params, [len(seq)])[0])
            seq.append(token)
            out.append(token)
            if token in eos and not params.ignore_eos:
                break
    return out


ROOT = Path(__file__).resolve().parents[1]


def start_node(role: str, model: Path, addr: str) -> subprocess.Popen:
    """A node process on `addr`, unprofiled, once it serves; its output is dropped."""
    from client.remote import wait_until_serving

    cmd = [sys.executable, "-m", f"{role}_node", "--model", str(model), "--listen", addr, "--no-profile",
           "--max-tree", "32"]  # fmt: skip
    proc = subprocess.Popen(
        cmd, env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT, stderr=subprocess.DEVNULL
    )
    wait_until_serving(addr, timeout=120, alive=lambda: proc.poll() is None)
    return proc


class Proc:
    """A server subprocess whose output goes to a file (a full pipe would block it), shown when a test fails."""

    def __init__(self, name: str, args: list[str], env: dict[str, str], logs: Path) -> None:
        self.name = name
        self.log = logs / f"{name}.log"
        self._file = self.log.open("wb")
        self.popen = subprocess.Popen(
            [sys.executable, *args], cwd=ROOT, env=env, stdout=self._file, stderr=subprocess.STDOUT
        )

    def alive(self) -> bool:
        return self.popen.poll() is None

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def wait_serving(self, address: str, security: Any = None, timeout: float = 120) -> None:
        from client.remote import wait_until_serving

        try:
            wait_until_serving(address, timeout=timeout, alive=self.alive, security=security)
        except Exception as exc:
            raise AssertionError(f"{self.name} did not start: {exc}\n{self.output()}") from exc

    def finish(self, timeout: float = 60) -> int:
        try:
            return self.popen.wait(timeout=timeout)
        finally:
            self._file.close()

    def terminate(self) -> None:
        if self.alive():
            self.popen.terminate()

    def stop(self) -> None:
        """SIGTERM (a graceful stop), then reap; `terminate` them all first to stop several at once."""
        self.terminate()
        if self.popen.returncode is None:
            try:
                self.popen.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        self._file.close()



@contextmanager
def node_pair(target_args: list[str], draft_args: list[str], env: dict[str, str], logs: Path) -> Iterator[dict[str, str]]:
    """A target node and a draft node on free loopback ports, serving until the block ends; yields
    their addresses. The args follow `--model M` (each node gets its own `--listen`)."""
    addrs = {"target": f"127.0.0.1:{free_port()}", "draft": f"127.0.0.1:{free_port()}"}
    procs = [Proc(role, ["-m", f"{role}_node", *args, "--listen", addrs[role]], env, logs)
             for role, args in (("target", target_args), ("draft", draft_args))]  # fmt: skip
    try:
        for proc, addr in zip(procs, addrs.values(), strict=True):
            proc.wait_serving(addr)
        yield addrs
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.stop()


SAMPLE_TREE = TokenTree(torch.tensor([3, 10, 11, 12, 13, 14, 15]), torch.tensor([-1, 0, 0, 1, 1, 3, 2]))


def prefix_then_tree(model: Any, prefix: torch.Tensor, tree: TokenTree) -> tuple[torch.Tensor, torch.Tensor]:
    """A causal pass over `prefix`, then one pass over `tree` in the slots after it; both hidden states."""
    structure = TreeStructure.from_parents(tree.parents)
    cache = model.new_cache(64)
    p = prefix.numel()
    causal = torch.ones(p, p, dtype=torch.bool).tril()
    first = model(prefix, torch.arange(p), torch.arange(p), attention_bias(causal, 0), cache)
    positions, slots = p + torch.from_numpy(structure.depths), torch.arange(p, p + tree.size)
    second = model(torch.from_numpy(tree.tokens), positions, slots, attention_bias(structure.ancestors, p), cache)
    return first, second


def gateway_answers(gen: Any, request: Any) -> list[Any]:
    """The GenerateResponses an in-process gRPC gateway in front of `gen` streams for `request`."""
    import grpc

    from client.gateway import GenerationServicer
    from common.pb.specexec.v1 import specexec_pb2_grpc as pb_grpc
    from common.rpc.server import Server

    servicer = GenerationServicer(lambda mode, tree: gen, gen)
    server = Server("127.0.0.1:0", [(pb_grpc.add_GenerationServiceServicer_to_server, servicer, "g")]).start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            return list(pb_grpc.GenerationServiceStub(channel).Generate(request, timeout=60))
    finally:
        server.stop(0)
