"""Two hosts: the draft node in one network namespace, the target node and the client in another,
joined by a veth pair. Latency comes from `tc netem` where the kernel has it, otherwise from a
delaying TCP relay on the client's side of the link (each chunk held back by the delay, both ways).
Output must not depend on the link; tokens/s may.

Traffic stays inside the two namespaces this test creates. Skipped, with the reason, where
namespaces cannot be made (not root, no iproute2, a sandbox that forbids them).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.helpers import reference_decode

ROOT = Path(__file__).resolve().parents[1]
DRAFT_IP, TARGET_IP = "10.77.0.1", "10.77.0.2"
PROMPT = [72, 101, 108, 108, 111, 44, 32]

CLIENT = """
import json, sys
from client.remote import connect
from common.decoding.sampling import SamplingParams
from common.decoding.tree import TreeParams
gen = connect(sys.argv[1], sys.argv[2], tree=TreeParams(budget=16, max_depth=8), step_timeout=30)
out = gen.generate(json.loads(sys.argv[3]), SamplingParams(temperature=0.8, seed=4, max_new_tokens=32, ignore_eos=True))
print(json.dumps({"ids": out.token_ids, "tps": out.stats.tokens_per_second, "steps": out.stats.target_steps}))
"""


RELAY = """
import asyncio, sys
listen_host, listen_port, dest_host, dest_port, delay = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), float(sys.argv[5]) / 1e3

async def pipe(reader, writer):
    try:
        while data := await reader.read(65536):
            await asyncio.sleep(delay)
            writer.write(data)
            await writer.drain()
    finally:
        writer.close()

async def handle(reader, writer):
    up_reader, up_writer = await asyncio.open_connection(dest_host, dest_port)
    await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer), return_exceptions=True)

async def main():
    server = await asyncio.start_server(handle, listen_host, listen_port)
    print("ready", flush=True)
    async with server:
        await server.serve_forever()

asyncio.run(main())
"""


def netem_available(ns: str, dev: str) -> bool:
    probe = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "netem",
                            "delay", "0ms"], capture_output=True)  # fmt: skip
    return probe.returncode == 0


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


@pytest.fixture(scope="module")
def hosts():
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
        pytest.skip("needs root and iproute2 (ip, tc) to create network namespaces")
    tag = uuid.uuid4().hex[:6]
    ns = {"draft": f"se-draft-{tag}", "target": f"se-target-{tag}"}
    veth = (f"sed{tag}", f"set{tag}")
    try:
        sh("ip", "netns", "add", ns["draft"])
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"cannot create network namespaces here: {exc.stderr.strip()}")
    try:
        sh("ip", "netns", "add", ns["target"])
        sh("ip", "link", "add", veth[0], "type", "veth", "peer", "name", veth[1])
        for dev, name, ip in ((veth[0], ns["draft"], DRAFT_IP), (veth[1], ns["target"], TARGET_IP)):
            sh("ip", "link", "set", dev, "netns", name)
            sh("ip", "-n", name, "addr", "add", f"{ip}/24", "dev", dev)
            sh("ip", "-n", name, "link", "set", dev, "up")
            sh("ip", "-n", name, "link", "set", "lo", "up")
        yield ns, veth
    finally:
        for name in ns.values():
            subprocess.run(["ip", "netns", "pids", name], capture_output=True)
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def in_ns(ns: str, *cmd: str, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(["ip", "netns", "exec", ns, *cmd], env=env, cwd=ROOT, **kwargs)


def wait_ready(ns: str, addr: str) -> None:
    probe = "import sys; from client.remote import wait_until_serving; wait_until_serving(sys.argv[1], 120)"
    assert in_ns(ns, sys.executable, "-c", probe, addr).wait(timeout=150) == 0


def test_output_is_identical_across_link_latencies(hosts, model_dirs, tmp_path):
    (ns, veth) = hosts
    draft_addr, target_addr = f"{DRAFT_IP}:50061", f"{TARGET_IP}:50062"
    nodes = [
        in_ns(ns["draft"], sys.executable, "-m", "draft_node", "--model", str(model_dirs["truncated"]),
              "--listen", draft_addr, "--insecure", "--no-profile", "--max-tree", "16"),
        in_ns(ns["target"], sys.executable, "-m", "target_node", "--model", str(model_dirs["target"]),
              "--listen", target_addr, "--insecure", "--no-profile", "--max-tree", "16"),
    ]  # fmt: skip
    relays: list[subprocess.Popen] = []
    try:
        wait_ready(ns["target"], draft_addr)
        wait_ready(ns["target"], target_addr)
        from common.decoding.sampling import SamplingParams

        expected = reference_decode(
            model_dirs["target"],
            PROMPT,
            SamplingParams(temperature=0.8, seed=4, max_new_tokens=32, ignore_eos=True),
        )
        report = []
        use_netem = netem_available(ns["draft"], veth[0]) and netem_available(ns["target"], veth[1])
        for delay_ms in (0, 1, 10):
            link = draft_addr
            if delay_ms and use_netem:
                for name, dev in ((ns["draft"], veth[0]), (ns["target"], veth[1])):
                    sh("ip", "netns", "exec", name, "tc", "qdisc", "replace", "dev", dev, "root", "netem",
                       "delay", f"{delay_ms}ms")  # fmt: skip
            elif delay_ms:
                port = 50070 + delay_ms
                relay = in_ns(ns["target"], sys.executable, "-c", RELAY, "127.0.0.1", str(port), DRAFT_IP, "50061",
                              str(delay_ms), stdout=subprocess.PIPE, text=True)  # fmt: skip
                relays.append(relay)
                assert relay.stdout.readline().strip() == "ready"
                link = f"127.0.0.1:{port}"
            start = time.perf_counter()
            client = in_ns(ns["target"], sys.executable, "-c", CLIENT, link, target_addr, json.dumps(PROMPT),
                           stdout=subprocess.PIPE, text=True)  # fmt: skip
            stdout, _ = client.communicate(timeout=300)
            assert client.returncode == 0
            result = json.loads(stdout.strip().splitlines()[-1])
            assert result["ids"] == expected, f"output changed with {delay_ms} ms of link latency"
            report.append((delay_ms, result["tps"], result["steps"], time.perf_counter() - start))
        mechanism = "tc netem on the veth pair" if use_netem else "delaying TCP relay"
        print(f"\nlatency via {mechanism}\nlink delay ms | tok/s | target steps")
        for delay, tps, steps, _ in report:
            print(f"{delay} | {tps:.1f} | {steps}")
    finally:
        for relay in relays:
            relay.kill()
        for node in nodes:
            node.terminate()
            node.wait(timeout=30)
