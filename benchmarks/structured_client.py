"""The structured-output benchmark's prompts through the official `openai` client against `viasd serve`:
does every answer hold, streamed and not, for every `tool_choice`?

For each JSON-schema prompt: `response_format` json_schema (strict); for each tool-call prompt:
`tool_choice` "required", "auto" and the reference's function by name. Each request is sent twice,
non-streamed and streamed (the stream reassembled from its `delta.content` and `delta.tool_calls`
fragments). A JSON answer must parse and validate (`jsonschema`); a tool call must name a declared
function with arguments valid under its parameters ("auto" may answer in text: counted apart); the
streamed answer must equal the non-streamed one (tool-call ids aside). Greedy; no timing.

    python benchmarks/structured_client.py --limit 8 --out benchmarks/out/structured_client.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import environment  # noqa: E402
from load import Server, cpu_flags  # noqa: E402
from structured import DATA, check_json, check_tools, load_rows, run_id_of  # noqa: E402


def reassemble(stream) -> dict:
    """A streamed chat completion as the message it spells: content, tool calls (by index), finish reason."""
    content, calls, finish = [], {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        if choice.delta.content:
            content.append(choice.delta.content)
        for tc in choice.delta.tool_calls or []:
            call = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            if tc.function is not None:
                call["name"] += tc.function.name or ""
                call["arguments"] += tc.function.arguments or ""
    tool_calls = [{"type": "function", "function": c} for _, c in sorted(calls.items())]
    return {"content": "".join(content) or None, "tool_calls": tool_calls or None, "finish_reason": finish}


def as_message(response) -> dict:
    m = response.choices[0].message
    calls = [{"type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}}
             for c in m.tool_calls or []]
    return {"content": m.content, "tool_calls": calls or None, "finish_reason": response.choices[0].finish_reason}


def cases(row: dict) -> list[tuple[str, dict]]:
    """(label, request fields) of one prompt."""
    if row["task"] == "json":
        fmt = {"type": "json_schema", "json_schema": {"name": row["schema_name"], "schema": row["schema"], "strict": True}}
        return [("json_schema", {"response_format": fmt})]
    named = {"type": "function", "function": {"name": row["reference"]["name"]}}
    return [(label, {"tools": row["tools"], "tool_choice": choice})
            for label, choice in (("required", "required"), ("auto", "auto"), ("named", named))]


def check(row: dict, label: str, message: dict) -> dict:
    if row["task"] == "json":
        return check_json(row, message)
    out = check_tools(row, message)
    out["text_answer"] = label == "auto" and not message.get("tool_calls")
    if label == "named" and message.get("tool_calls"):
        out["named_kept"] = message["tool_calls"][0]["function"]["name"] == row["reference"]["name"]
    return out


def run(client, rows: list[dict], args, run_id: str, env: dict) -> list[dict]:
    records = []
    for row in rows:
        for label, fields in cases(row):
            common = dict(model=args.model, messages=row["messages"], max_tokens=args.max_tokens, temperature=0.0,
                          extra_body={"viasd": {"strategy": args.strategy}}, **fields)
            whole = as_message(client.chat.completions.create(**common))
            streamed = reassemble(client.chat.completions.create(stream=True, **common))
            rec = {"run_id": run_id, "prompt_id": row["id"], "task": row["task"], "case": label,
                   "strategy": args.strategy, "message": whole, "streamed_equal": streamed == whole,
                   **check(row, label, whole), "env": env}
            print(f"[client] {row['id']} {label}: valid {rec['schema_valid']}, streamed equal {rec['streamed_equal']}"
                  f"{', text answer' if rec.get('text_answer') else ''}", flush=True)
            records.append(rec)
    return records


def summary(records: list[dict]) -> str:
    lines = ["| case | n | valid | text answers (auto) | streamed = non-streamed | named function kept |",
             "|---|---|---|---|---|---|"]
    for label in ("json_schema", "required", "auto", "named"):
        rs = [r for r in records if r["case"] == label]
        if not rs:
            continue
        calls = [r for r in rs if not r.get("text_answer")]
        named = [r["named_kept"] for r in rs if "named_kept" in r]
        lines.append(f"| {label} | {len(rs)} | {sum(r['schema_valid'] for r in calls)}/{len(calls)} | "
                     f"{sum(bool(r.get('text_answer')) for r in rs)} | {sum(r['streamed_equal'] for r in rs)}/{len(rs)} | "
                     f"{f'{sum(named)}/{len(named)}' if named else '-'} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--strategy", default="pld", help="the viasd strategy every request names (default: %(default)s)")
    p.add_argument("--limit", type=int, default=None, help="the first N prompts of each task (default: all)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--data", default=str(DATA))
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "out" / "structured_client.jsonl"))
    args = p.parse_args(argv)
    out = Path(args.out)
    if out.exists() and out.stat().st_size:
        p.error(f"{out} is not empty: give a new --out")
    import openai

    rows = load_rows(Path(args.data), ["json", "tools"], args.limit)
    run_id, env = run_id_of([], False, out), {**environment(), "cpu_flags": cpu_flags()}
    server = Server(args.model, 0, 600, ["--prefix-cache-mb", "0"])
    try:
        records = run(openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused"), rows, args, run_id, env)
    finally:
        server.stop()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
    tmp.replace(out)
    print(summary(records))
    print(f"[client] run {run_id}: {len(records)} record(s) in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
