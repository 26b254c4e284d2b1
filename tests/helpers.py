"""Independent references for exactness tests: they share no cache, tree or session code with the engine."""

from __future__ import annotations

import socket

import torch
from transformers import AutoModelForCausalLM

from common.sampling import SamplingParams, sample_rows


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
            token = int(sample_rows(logits, params, [len(seq)])[0])
            seq.append(token)
            out.append(token)
            if token in eos and not params.ignore_eos:
                break
    return out


def free_port() -> int:
    """A loopback port nobody listens on now (tests start their servers on it right away)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
