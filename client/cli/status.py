"""`specexec status`: is the pair up and usable? Health, models, tokenizer match, sessions, round-trip
time, and (from the target's --metrics-port) acceptance.

    specexec status --draft laptop:50052 --target desktop:50051 [--target-metrics desktop:9101]

Exit status 0 when every node given is SERVING (and, with both, their tokenizers match), else 1.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import time
import urllib.request
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from client.remote import open_channel, tls_hint
from common.options import add_client_security_args, client_security, positive_float, positive_int
from common.pb.specexec.v1 import specexec_pb2 as pb
from common.pb.specexec.v1 import specexec_pb2_grpc as pb_grpc

SPEC = "specexec:spec_decode_"


def add_status_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", help="target node HOST:PORT")
    p.add_argument("--draft", help="draft node HOST:PORT")
    p.add_argument(
        "--target-metrics",
        metavar="[HOST:]PORT|URL",
        help="the target's --metrics-port, to report acceptance (HOST defaults to the --target host)",
    )
    p.add_argument(
        "--window",
        type=float,
        default=0.0,
        help="report acceptance over this many seconds (two scrapes) instead of since the node started",
    )
    p.add_argument("--pings", type=positive_int, default=5, help="Info calls that measure the round-trip time")
    p.add_argument("--timeout", type=positive_float, default=5.0, help="seconds per call")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_client_security_args(p)
    p.set_defaults(func=cmd_status)


def probe(address: str, role: str, security: Any, pings: int, timeout: float) -> dict[str, Any]:
    """Health, then `pings` Info calls: the first answer describes the node, all of them time it."""
    out: dict[str, Any] = {"role": role, "address": address}
    with open_channel(address, security.channel_credentials()) as channel:
        try:
            health = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=timeout
            )
            out["health"] = health_pb2.HealthCheckResponse.ServingStatus.Name(health.status)
        except grpc.RpcError as exc:
            out["health"] = "UNREACHABLE"
            out["error"] = f"{exc.code().name}: {exc.details()}{tls_hint(exc.code(), exc.details(), security)}"
            return out
        stub = pb_grpc.TargetServiceStub(channel) if role == "target" else pb_grpc.DraftServiceStub(channel)
        rtts, info = [], None
        try:
            for _ in range(max(1, pings)):
                start = time.perf_counter()
                info = stub.Info(pb.InfoRequest(), timeout=timeout, metadata=security.metadata())
                rtts.append(time.perf_counter() - start)
        except grpc.RpcError as exc:
            out["error"] = f"Info: {exc.code().name}: {exc.details()}"
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                out["error"] = f"not a {role} node: it does not serve the {role} node's service"
            return out
    assert info is not None
    if info.role and info.role != role:
        out["error"] = f"this is a {info.role} node, not a {role} node"
    out.update(
        model=info.model_id,
        dtype=info.dtype,
        device=info.device,
        max_context=info.max_context,
        max_tree_nodes=info.max_tree_nodes,
        open_sessions=info.open_sessions,
        max_sessions=info.max_sessions,
        server_version=info.server_version,
        tokenizer=info.tokenizer_fingerprint,
        profiled=len(info.forward_curve) > 0,
        rtt_ms_median=round(statistics.median(rtts) * 1e3, 3),
        rtt_ms_min=round(min(rtts) * 1e3, 3),
    )
    return out


def metrics_url(spec: str, target: str | None) -> str:
    if spec.startswith(("http://", "https://")):
        return spec if spec.rstrip("/").endswith("/metrics") else spec.rstrip("/") + "/metrics"
    host, _, port = spec.rpartition(":")
    if not host:
        host = target.rpartition(":")[0] if target else "127.0.0.1"
    return f"http://{host}:{port}/metrics"


def scrape(url: str, timeout: float) -> dict[str, Any]:
    """The target's speculative-decoding counters, summed over models."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=timeout) as response:
        text = response.read().decode()
    out: dict[str, Any] = {"drafts": 0.0, "draft_tokens": 0.0, "accepted": 0.0, "per_position": {}}
    names = {
        SPEC + "num_drafts": "drafts",
        SPEC + "num_draft_tokens": "draft_tokens",
        SPEC + "num_accepted_tokens": "accepted",
    }
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.endswith("_total"):
                continue
            if family.name in names:
                out[names[family.name]] += sample.value
            elif family.name == SPEC + "num_accepted_tokens_per_pos":
                pos = int(sample.labels["position"])
                out["per_position"][pos] = out["per_position"].get(pos, 0.0) + sample.value
    return out


def acceptance(before: dict[str, Any] | None, after: dict[str, Any]) -> dict[str, Any]:
    def delta(key: str) -> float:
        return after[key] - (before[key] if before else 0.0)

    drafts, draft_tokens, accepted = delta("drafts"), delta("draft_tokens"), delta("accepted")
    per_pos = {
        p: v - (before["per_position"].get(p, 0.0) if before else 0.0)
        for p, v in after["per_position"].items()
    }
    return {
        "drafts": int(drafts),
        "draft_tokens": int(draft_tokens),
        "accepted_tokens": int(accepted),
        "mean_acceptance_length": round(1 + accepted / drafts, 3) if drafts else None,
        "acceptance_rate": round(accepted / draft_tokens, 4) if draft_tokens else None,
        "per_position": {str(p): round(per_pos[p] / drafts, 4) for p in sorted(per_pos)} if drafts else {},
    }


def status(args: argparse.Namespace) -> dict[str, Any]:
    security = client_security(args)
    report: dict[str, Any] = {"nodes": []}
    for role in ("target", "draft"):
        address = getattr(args, role)
        if address:
            report["nodes"].append(probe(address, role, security, args.pings, args.timeout))
    fingerprints = {n["role"]: n.get("tokenizer") for n in report["nodes"]}
    if len(fingerprints) == 2 and all(fingerprints.values()):
        report["tokenizer_match"] = fingerprints["target"] == fingerprints["draft"]
    if args.target_metrics:
        url = metrics_url(args.target_metrics, args.target)
        try:
            before = scrape(url, args.timeout) if args.window > 0 else None
            if before is not None:
                time.sleep(args.window)
            report["acceptance"] = {
                "url": url,
                "window_s": args.window or None,
                **acceptance(before, scrape(url, args.timeout)),
            }
        except (OSError, ValueError) as exc:
            report["acceptance"] = {"url": url, "error": str(exc)}
        except http.client.HTTPException as exc:  # a gRPC port, say: its answer is no HTTP
            report["acceptance"] = {"url": url, "error": f"not an HTTP metrics endpoint ({type(exc).__name__})"}
    report["ok"] = bool(report["nodes"]) and all(
        n.get("health") == "SERVING" and "error" not in n for n in report["nodes"]
    )
    report["ok"] = report["ok"] and report.get("tokenizer_match", True) and "error" not in report.get("acceptance", {})
    return report


def render(report: dict[str, Any]) -> str:
    lines = []
    for n in report["nodes"]:
        head = f"{n['role']:6} {n['address']}  {n['health']}"
        if "rtt_ms_median" in n:
            head += f"  rtt {n['rtt_ms_median']:.2f} ms (median), {n['rtt_ms_min']:.2f} ms (min)"
        lines.append(head)
        if "model" in n:
            lines.append(
                f"       model {n['model']} ({n['dtype']}, {n['device']}), context {n['max_context']}, "
                f"tree <= {n['max_tree_nodes']} nodes, sessions {n['open_sessions']}/{n['max_sessions']}, "
                f"server {n['server_version']}, forward curve {'measured' if n['profiled'] else 'not measured'}"
            )
        if "error" in n:
            lines.append(f"       error: {n['error']}")
    if "tokenizer_match" in report:
        fp = next(n["tokenizer"] for n in report["nodes"] if n["role"] == "target")
        lines.append(f"tokenizer: {'match' if report['tokenizer_match'] else 'MISMATCH'} (target {fp})")
    acc = report.get("acceptance")
    if acc is not None:
        if "error" in acc:
            lines.append(f"acceptance: metrics unreachable at {acc['url']}: {acc['error']}")
        elif not acc["drafts"]:
            lines.append(f"acceptance: no drafted steps yet ({acc['url']})")
        else:
            span = f"last {acc['window_s']:g} s" if acc["window_s"] else "since start"
            positions = ", ".join(f"{p}: {v:.0%}" for p, v in list(acc["per_position"].items())[:8])
            lines.append(
                f"acceptance ({span}): {acc['drafts']} drafts, mean acceptance length "
                f"{acc['mean_acceptance_length']:.2f}, {acc['accepted_tokens']}/{acc['draft_tokens']} draft "
                f"tokens accepted; per position {positions}"
            )
    lines.append("status: ok" if report["ok"] else "status: NOT OK")
    return "\n".join(lines)


def cmd_status(args: argparse.Namespace) -> int:
    if not args.target and not args.draft:
        raise ValueError("status needs --target HOST:PORT and/or --draft HOST:PORT")
    report = status(args)
    print(json.dumps(report) if args.json else render(report))
    return 0 if report["ok"] else 1
