"""Rebuild `bfcl_structured.jsonl` (the prompts of `benchmarks/structured.py`) from the bfcl-eval wheel.

    python benchmarks/data/select_bfcl.py                    # pip downloads bfcl-eval==2026.3.23
    python benchmarks/data/select_bfcl.py --wheel PATH.whl   # or reads this wheel

Selection (deterministic; see README.md here): from BFCL v4's `live_simple` (JSON-schema extraction
prompts), `simple_python` and `multiple` (tool-call prompts), the entries with one user turn, one
reference call whose acceptable values are scalars or lists of scalars, each argument with an acceptable
value its parameter's schema admits, and parameter types that map to JSON Schema; then --per-category of them evenly
spaced over each file (file order).
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
WHEEL = "bfcl-eval==2026.3.23"
# BFCL's own mapping to OpenAPI types (bfcl_eval/constants/type_mappings.py, GORILLA_TO_OPENAPI), Python types only
TYPES = {"integer": "integer", "number": "number", "float": "number", "string": "string", "boolean": "boolean",
         "bool": "boolean", "array": "array", "list": "array", "dict": "object", "object": "object", "tuple": "array",
         "any": "string"}
CATEGORIES = {"live_simple": "json", "simple_python": "tools", "multiple": "tools"}
JSON_PROMPT = ("Extract the arguments of the function `{name}` ({description}) from the request below, as one JSON "
               "object that matches this JSON schema:\n{schema}\n\nRequest: {question}")


def to_schema(node: dict) -> dict | None:
    """A BFCL parameter schema as JSON Schema: its types mapped as BFCL maps them for OpenAI, BFCL's
    `optional` key dropped, `additionalProperties: false` on objects (strict); None when a type is unknown."""
    node = copy.deepcopy(node)
    node.pop("optional", None)
    if "type" in node:
        if node["type"] not in TYPES:
            return None
        node["type"] = TYPES[node["type"]]
    if isinstance(node.get("items"), dict):
        node["items"] = to_schema(node["items"])
        if node["items"] is None:
            return None
    if isinstance(node.get("properties"), dict):
        props = {k: to_schema(v) for k, v in node["properties"].items()}
        if any(v is None for v in props.values()):
            return None
        node["properties"] = props
    if node.get("type") == "object":
        node.setdefault("properties", {})
        node["additionalProperties"] = False
    return node


def oai_name(name: str) -> str:
    """OpenAI's function names allow no `.`: BFCL replaces it with `_` for OpenAI-style models; so do we."""
    return re.sub(r"\.", "_", name)


def flat(values: list) -> bool:
    scalar = lambda v: isinstance(v, (str, int, float, bool))  # noqa: E731
    return all(scalar(v) or (isinstance(v, list) and all(scalar(x) for x in v)) for v in values)


def attainable(ref_args: dict, params: dict) -> bool:
    """Every reference argument is a declared parameter and has an acceptable value its schema admits
    (`""`: may be left out), so an answer under the constraint can match it exactly."""
    import jsonschema

    props = params["properties"]
    return all(k in props and any(v == "" or jsonschema.Draft202012Validator(props[k]).is_valid(v) for v in vs)
               for k, vs in ref_args.items())


def convert(entry: dict, answer: dict, category: str) -> dict | None:
    """One vendored row, or None when the entry does not qualify."""
    turns = entry["question"]
    if len(turns) != 1 or len(turns[0]) != 1 or turns[0][0]["role"] != "user" or len(answer["ground_truth"]) != 1:
        return None
    ((ref_name, ref_args),) = answer["ground_truth"][0].items()
    if not all(flat(v) for v in ref_args.values()):
        return None
    tools = []
    for f in entry["function"]:
        params = to_schema({**f["parameters"], "type": "dict"})
        if params is None:
            return None
        tools.append({"type": "function", "function": {"name": oai_name(f["name"]), "description": f["description"], "parameters": params}})
    (target,) = [t["function"] for t in tools if t["function"]["name"] == oai_name(ref_name)]
    if not attainable(ref_args, target["parameters"]):
        return None
    row = {"id": entry["id"], "source": f"bfcl-eval 2026.3.23: BFCL_v4_{category}", "task": CATEGORIES[category],
           "reference": {"name": oai_name(ref_name), "arguments": ref_args}}
    question = turns[0][0]["content"]
    if row["task"] == "json":
        text = JSON_PROMPT.format(name=target["name"], description=target["description"],
                                  schema=json.dumps(target["parameters"]), question=question)
        return {**row, "messages": [{"role": "user", "content": text}], "schema_name": target["name"], "schema": target["parameters"]}
    return {**row, "messages": [{"role": "user", "content": question}], "tools": tools}


def read_jsonl(zf: zipfile.ZipFile, name: str) -> list[dict]:
    return [json.loads(line) for line in zf.read(name).decode().splitlines() if line.strip()]


def select(wheel: Path, per_category: int) -> list[dict]:
    rows = []
    with zipfile.ZipFile(wheel) as zf:
        for category in CATEGORIES:
            entries = read_jsonl(zf, f"bfcl_eval/data/BFCL_v4_{category}.json")
            answers = {a["id"]: a for a in read_jsonl(zf, f"bfcl_eval/data/possible_answer/BFCL_v4_{category}.json")}
            ok = [r for e in entries if e["id"] in answers and (r := convert(e, answers[e["id"]], category)) is not None]
            n = min(per_category, len(ok))
            rows += [ok[i * len(ok) // n] for i in range(n)]
            print(f"{category}: {len(ok)} of {len(entries)} qualify, {n} taken", file=sys.stderr)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--wheel", type=Path, help=f"the {WHEEL} wheel (default: pip download it)")
    p.add_argument("--per-category", type=int, default=12, help="prompts per BFCL category (default: %(default)s)")
    p.add_argument("--out", type=Path, default=HERE / "bfcl_structured.jsonl")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        wheel = args.wheel
        if wheel is None:
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", WHEEL, "-d", tmp], check=True)
            (wheel,) = Path(tmp).glob("bfcl_eval-*.whl")
        rows = select(wheel, args.per_category)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{len(rows)} rows written to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
