"""How the quickstart's target answers when it is offered tools: in Hermes `<tool_call>` tags, as bare
JSON (which `client.openai.tool_calls` also reads, where vLLM's and Ollama's parsers return text), or
in words; and whether the call names the right tool with the schema's required arguments.

Greedy, target alone (a speculative run gives the same text on an F32 file, nearly so on Q4_K_M). The
prompts are rendered with the model's own chat template and tools, as the OpenAI endpoint renders them.

    .venv/bin/python -m benchmarks.tool_calls --target qwen2.5-coder-1.5b --out docs/tool-calls/report.md
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tqdm import tqdm

from client.api import SpecExec, render_chat
from client.openai.tool_calls import OPEN, read_tool_calls
from common.decoding.sampling import SamplingParams


def tool(name: str, description: str, **properties: str) -> dict:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": {k: {"type": "string", "description": v}
                                                         for k, v in properties.items()},
                       "required": list(properties)}}}  # fmt: skip


TOOLS = [
    tool("get_weather", "The current weather in a city", city="the city's name"),
    tool("read_file", "Read a file of the user's project", path="the file's path"),
    tool("run_shell", "Run a shell command in the user's project", command="the command line"),
    tool("search_web", "Search the web", query="what to search for"),
    tool("send_email", "Send an email", to="the address", subject="the subject", body="the text"),
]

# (the user's message, the tool a right answer calls; None: none is needed)
TASKS = [
    ("What's the weather in Paris right now?", "get_weather"),
    ("Is it raining in Tokyo?", "get_weather"),
    ("Show me what is in setup.py.", "read_file"),
    ("Open src/main.rs and tell me what it does.", "read_file"),
    ("List the files in the current directory.", "run_shell"),
    ("Run the test suite with pytest.", "run_shell"),
    ("Find out who won the 2022 World Cup final.", "search_web"),
    ("Look up the latest Python release online.", "search_web"),
    ("Email bob@example.com that the build is fixed.", "send_email"),
    ("Send alice@example.com a note saying the meeting moved to 3pm.", "send_email"),
    ("What is 17 times 23?", None),
    ("Write a Python function that reverses a string.", None),
]


def classify(text: str, names: frozenset[str]) -> tuple[str, list]:
    """The calls the endpoint reads, and the form they came in."""
    _, calls = read_tool_calls(text, names=names)
    return ("tags" if OPEN in text else "bare", calls) if calls else ("text", [])


def right(calls: list, want: str | None) -> bool:
    if want is None:
        return not calls
    if not calls or calls[0].name != want:
        return False
    required = next(t for t in TOOLS if t["function"]["name"] == want)["function"]["parameters"]["required"]
    arguments = json.loads(calls[0].arguments)
    return isinstance(arguments, dict) and all(arguments.get(k) for k in required)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="qwen2.5-coder-1.5b", help="a GGUF, or a default model installed --format gguf")
    p.add_argument("--tokens", type=int, default=160)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    gen = SpecExec.local(None, args.target, backend="llama.cpp", mode="autoregressive")
    names = frozenset(t["function"]["name"] for t in TOOLS)
    rows = []
    for message, want in tqdm(TASKS, desc="tasks"):
        ids = render_chat(gen.tokenizer, [{"role": "user", "content": message}], tools=TOOLS)
        text = gen.generate(ids, SamplingParams(max_new_tokens=args.tokens, temperature=0)).text
        form, calls = classify(text, names)
        rows.append((message, want, form, calls[0].name if calls else "", right(calls, want)))
    lines = [f"Target {args.target}, greedy, {len(TOOLS)} tools offered, {args.tokens} tokens at most.", "",
             "| request | right tool | answered as | first call | right |", "|---|---|---|---|---|"]  # fmt: skip
    lines += [f"| {m} | {w or '(none)'} | {f} | {c} | {'yes' if ok else 'no'} |" for m, w, f, c, ok in rows]
    forms = {f: sum(1 for r in rows if r[2] == f) for f in ("tags", "bare", "text")}
    lines += ["", f"Answered in tags {forms['tags']}, as bare JSON {forms['bare']}, in words {forms['text']}; "
              f"right {sum(r[4] for r in rows)} of {len(rows)} (read as calls without the bare-JSON reading: "
              f"{sum(ok if f != 'bare' else w is None for _, w, f, _, ok in rows)})."]  # fmt: skip
    report = "\n".join(lines)
    print(report)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(f"# Tool calls on the quickstart's target\n\n`{' '.join(['python -m benchmarks.tool_calls', *[f'--target {args.target}', f'--tokens {args.tokens}']])}`\n\n{report}\n")


if __name__ == "__main__":
    main()
