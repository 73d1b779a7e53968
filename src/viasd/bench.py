"""`viasd bench`: methods x tasks in one run, one JSONL record per (prompt, method), resumable.

Methods run interleaved per prompt (after a warm-up), so machine drift hits all alike; every record
carries the full configuration, the environment and all decode statistics, plus task quality.
Rerunning the same command skips records already written; records are appended and flushed one at
a time, so Ctrl-C loses nothing written.
"""

from __future__ import annotations

import json
import os
import platform
import stat
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from viasd import compute
from viasd.api import GenerateConfig, generate
from viasd.decoding.registry import BASELINE, STRATEGIES, DraftKind, Mode
from viasd.datasets import SPEC_BENCH_CATEGORIES, human_eval, spec_bench
from viasd.errors import NotWritableError, OutputBusyError, UsageError
from viasd.quality import humaneval_completion, score
from viasd.validation import MAX_INPUT_BYTES, check_int, check_text, decode_utf8, dumps_strict, lock_beside, read_capped

# a results file is read whole on resume (and by `viasd report`): more than this is not one
RESULTS_MAX_BYTES = 1 << 30

# method -> GenerateConfig settings: each strategy by its name, VIA-SD once per mode; a suffix
# ":pld" / ":self" / ":model" picks the drafter kind of strategies that let --draft choose
METHODS: dict[str, dict] = {
    name + (f"-{mode.value}" if spec.multitier else ""): {"strategy": name, **({"mode": mode.value} if spec.multitier else {})}
    for name, spec in STRATEGIES.items() for mode in (Mode if spec.multitier else [Mode.LOSSLESS])
}
TASKS = tuple(f"spec_bench:{c}" for c in SPEC_BENCH_CATEGORIES) + ("spec_bench", "human_eval", "file:PATH", "file:PATH:METRIC")


@dataclass
class Prompt:
    task: str  # "spec_bench/translation", "human_eval", "file:my.jsonl"
    id: str
    text: str
    chat: bool | None  # None: the model's chat template when it has one
    reference: object = None
    problem: dict | None = None  # HumanEval problem, for pass@1
    follow_up: str | None = None  # MT-bench second question (--turns 2): asked after the model's answer
    metric: str | None = None  # a `file:` task's quality metric (quality.METRICS); None: the task's default


def parse_methods(spec: str) -> list[tuple[str, dict]]:
    """(name, GenerateConfig settings) of each method, in order; a repeated method (the same
    settings, whatever its spelling) is kept once, where it first appears."""
    out, seen = [], set()
    for name in [m.strip() for m in spec.split(",") if m.strip()]:
        method, _, drafter_name = name.partition("@")
        head, *modifiers = method.split("+")
        base, _, kind = head.partition(":")
        if base not in METHODS:
            raise UsageError(f"unknown method {name!r}: choose from {', '.join(METHODS)} (optionally :pld, :self or :model, "
                             "and +adapt or +fixed, +correct for viasd-tiered, +SETTING=VALUE, and @DRAFTER)")
        settings = dict(METHODS[base])
        if kind:
            if (kind not in (DraftKind.PLD, DraftKind.SELF, DraftKind.MODEL)
                    or STRATEGIES[settings["strategy"]].drafter is not DraftKind.AUTO):
                raise UsageError(f"method {name!r}: a drafter suffix (:pld, :self, :model) applies to cascade and viasd-* only")
            settings["draft"] = kind
            STRATEGIES[settings["strategy"]].draft_kind(kind, True)  # a kind the strategy cannot draft with: refused here
        spec_ = STRATEGIES[settings["strategy"]]
        for modifier in modifiers:
            if "=" in modifier:  # any declared setting: +k=8, +temperature=0.7, +slim_layers=0/1/5
                settings.update(_setting_option(name, modifier))
                continue
            if modifier == "correct":
                if settings.get("mode") != "tiered":
                    raise UsageError(f"method {name!r}: +correct applies to viasd-tiered only")
                settings["correct"] = True
                continue
            if modifier not in ("adapt", "fixed") or spec_.drafter is None:
                raise UsageError(f"method {name!r}: the modifiers are +adapt and +fixed (draft lengths from measured "
                                 "costs, or always k), for sd, pld, self-sd, cascade and viasd-*, +correct "
                                 "for viasd-tiered, and +SETTING=VALUE for any setting of `viasd generate`")
            settings["adapt_k"] = modifier == "adapt"
        if drafter_name:
            if _draft_kind(settings, True) is not DraftKind.MODEL:
                raise UsageError(f"method {name!r}: @DRAFTER names the drafter model of sd, cascade:model and viasd-*:model")
            settings["drafter"] = drafter_name
        key = tuple(sorted((k, str(v)) for k, v in settings.items()))
        if key in seen:  # `ar,ar` or `sd+adapt,sd+adapt+adapt`: the same configuration, run (and written) once
            continue
        seen.add(key)
        out.append((name, settings))
    if not out:
        raise UsageError("no methods given")
    return out


def _setting_option(method: str, option: str) -> dict:
    """A method's `+name=value` option as a setting, parsed and checked as the declaration says."""
    from viasd.settings import SETTINGS, check_setting, parse_value

    key, _, text = option.partition("=")
    if key not in SETTINGS or key == "strategy":
        raise UsageError(f"method {method!r}: +{option} names no setting (settings: "
                         f"{', '.join(n for n in SETTINGS if n != 'strategy')})")
    return {key: check_setting(SETTINGS[key], parse_value(SETTINGS[key], text))}


def _draft_kind(settings: dict, has_model: bool) -> DraftKind | None:
    return STRATEGIES[settings["strategy"]].draft_kind(settings.get("draft", DraftKind.AUTO), has_model)


def drafter_of(settings: dict, drafters: dict) -> tuple[object | None, str | None]:
    """The drafter model a method runs with (None: it drafts without one), or why it cannot run."""
    if _draft_kind(settings, bool(drafters)) is not DraftKind.MODEL:
        return None, None
    name = settings.get("drafter")
    if name is None:
        return (next(iter(drafters.values())), None) if drafters else (None, "needs --drafter")
    return (drafters[name], None) if name in drafters else (None, f"needs --drafter {name}")


def load_tasks(spec: str, limit: int | None, turns: int = 1) -> list[Prompt]:
    if limit is not None:
        check_int("--limit", limit, 1)  # a negative slice bound would silently mean "all but N"
    check_text("--tasks", spec)
    prompts: list[Prompt] = []
    tasks = list(dict.fromkeys(t.strip() for t in spec.split(",") if t.strip()))  # a repeated task runs once
    for task in tasks:
        if task.startswith("spec_bench"):
            _, _, category = task.partition(":")
            cats = [category] if category else list(SPEC_BENCH_CATEGORIES)
            for cat in cats:
                if cat not in SPEC_BENCH_CATEGORIES:
                    raise UsageError(f"unknown Spec-Bench category {cat!r}: choose from {', '.join(SPEC_BENCH_CATEGORIES)}")
                for row in spec_bench(cat)[:limit]:
                    follow_up = row["turns"][1] if cat == "mt_bench" and turns == 2 and len(row["turns"]) > 1 else None
                    prompts.append(Prompt(f"spec_bench/{cat}", str(row["question_id"]), row["turns"][0], None,
                                          row.get("reference"), follow_up=follow_up))
        elif task == "human_eval":
            for problem in human_eval()[:limit]:
                prompts.append(Prompt("human_eval", problem["task_id"], problem["prompt"], False, problem=problem))
        elif task.startswith("file:"):
            path, metric = _file_task(task)
            prompts += _file_prompts(path, task, limit, metric)
        else:
            raise UsageError(f"unknown task {task!r}: choose from {', '.join(TASKS)}")
    if not prompts:
        raise UsageError(f"no prompts in tasks {spec!r}")
    # overlapping tasks (spec_bench and spec_bench:translation) ask some prompts twice: once each, first kept
    seen: set[tuple[str, str]] = set()
    unique: list[Prompt] = []
    for p in prompts:
        if (p.task, p.id) not in seen:
            seen.add((p.task, p.id))
            unique.append(p)
    return unique


def _file_task(task: str) -> tuple[Path, str | None]:
    """`file:PATH` or `file:PATH:METRIC` -> (path, metric or None)."""
    from viasd.quality import METRICS

    rest = task[5:]
    head, sep, tail = rest.rpartition(":")
    if sep and tail in METRICS:
        return Path(head), tail
    return Path(rest), None


def _file_prompts(path: Path, task: str, limit: int | None, metric: str | None = None) -> list[Prompt]:
    from viasd.quality import METRICS

    if not path.exists():
        raise UsageError(f"{task}: no such file")
    out: list[Prompt] = []
    lines: dict[str, int] = {}
    data = read_capped(path, "task", UsageError)
    for n, line in enumerate(decode_utf8(data, str(path)).splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (ValueError, RecursionError) as e:
            raise UsageError(f"{path}:{n}: not JSON ({e})") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise UsageError(f"{path}:{n}: each line needs a string field 'prompt' (and optionally 'reference')")
        if not row["prompt"].strip():
            raise UsageError(f"{path}:{n}: the prompt is empty")
        check_text(f"{path}:{n}: prompt", row["prompt"])
        row_metric = row.get("metric", metric)
        if row_metric is not None and row_metric not in METRICS:
            raise UsageError(f"{path}:{n}: unknown metric {row_metric!r}: choose from {', '.join(METRICS)}")
        pid = str(row.get("id", n))
        if pid in lines:  # resuming keys records by id: the second prompt would be skipped as done
            raise UsageError(f"{path}:{n}: duplicate id {pid!r} (line {lines[pid]} has it too): "
                             "every prompt of a task file needs its own id")
        lines[pid] = n
        out.append(Prompt(task, pid, row["prompt"], None, row.get("reference"), metric=row_metric))
    return out[:limit]


def environment() -> dict:
    import torch
    import transformers

    from viasd.version import __version__

    cpu, flags = platform.processor(), []
    try:
        info = open("/proc/cpuinfo").read().splitlines()
        cpu = next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
        have = set(next(line.split(":", 1)[1].split() for line in info if line.startswith("flags")))
        flags = sorted(have & _SPEED_FLAGS)
    except (OSError, StopIteration):
        pass
    return {"viasd": __version__, "git_commit": source_commit(), "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "threads": torch.get_num_threads(), "cpu": cpu,
            "cpu_flags": flags, "cpu_count": os.cpu_count(), "platform": platform.platform()}


def source_commit() -> str | None:
    """The git commit of the checkout viasd runs from (an editable install), with "-dirty" when its
    tracked files differ from it; None for an installed wheel or without git."""
    import subprocess

    src = Path(__file__).resolve().parent
    try:
        run = lambda *a: subprocess.run(["git", "-C", str(src), *a], capture_output=True, text=True, timeout=10)  # noqa: E731
        head = run("rev-parse", "--short", "HEAD")
        if head.returncode != 0:
            return None
        dirty = run("status", "--porcelain", "--untracked-files=no", "--", ".").stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return head.stdout.strip() + ("-dirty" if dirty else "")


# the CPU features that decide which kernels run (figures from CPUs that differ here are not comparable)
_SPEED_FLAGS = {"avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
                "avx_vnni", "amx_int8", "amx_bf16", "amx_tile"}


def read_records(out: Path) -> tuple[list[dict], int]:
    """(records, lines skipped) of a results file: a line that is not a JSON object with string
    'task', 'prompt_id' and 'method' (a torn fragment of a killed run, a foreign line) is skipped."""
    try:
        regular = stat.S_ISREG(out.stat().st_mode)
    except FileNotFoundError:
        return [], 0
    except OSError:
        regular = False  # read_capped names the fault
    # a pipe or device (/dev/zero) is read up to the input cap only
    return _parse_records(read_capped(out, "bench results", UsageError, RESULTS_MAX_BYTES if regular else MAX_INPUT_BYTES))


def _parse_records(data: bytes) -> tuple[list[dict], int]:
    records, skipped = [], 0
    for line in data.decode("utf-8", errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except (ValueError, RecursionError):
            skipped += 1
            continue
        if isinstance(r, dict) and all(isinstance(r.get(k), str) for k in ("task", "prompt_id", "method")):
            records.append(r)
        else:
            skipped += 1
    return records, skipped


def check_results_file(out: Path) -> Path:
    """Refuse, before any work, an existing `--out` that is not a bench results file: appending
    records to notes.txt (or to /dev/zero) would damage it. A file holding at least one record
    (perhaps with foreign lines, which are skipped, or the torn tail of a killed run) is fine."""
    out = Path(out)
    try:
        st = out.stat()
    except FileNotFoundError:
        return out
    except OSError as e:
        raise NotWritableError(f"results file {out}: cannot read it ({e.strerror or e})") from None
    if not stat.S_ISREG(st.st_mode):
        raise NotWritableError(f"results file {out} exists and is not a regular file: choose another --out")
    data = read_capped(out, "bench results", UsageError, RESULTS_MAX_BYTES)
    end = data.rfind(b"\n") + 1
    if data[end:].startswith(b'{"task"'):
        data = data[:end]  # a killed run's torn last record
    if data.strip() and not _parse_records(data)[0]:
        raise NotWritableError(f"results file {out} exists and holds no viasd bench records: refusing to append to it "
                               "(choose another --out, or remove the file)")
    return out


def lock_path(out: Path) -> Path:
    """The lock file a bench run holds while it writes `out` (beside it: OUT.lock)."""
    out = Path(out)
    return out.with_name(out.name + ".lock")


_held: dict[str, list] = {}  # resolved results path -> [lock fd, depth]: the CLI and run_bench take the same lock


@contextmanager
def results_lock(out: Path):
    """Hold the results file for this run: a second bench on the same file (which would redo and
    append every record again) is refused at once with OutputBusyError. Reentrant in one process."""
    key = str(Path(out).resolve())
    if key in _held:
        _held[key][1] += 1
        try:
            yield
        finally:
            _held[key][1] -= 1
        return
    fd = lock_beside(out, "results file")
    if fd is None:
        raise OutputBusyError(f"results file {out}: another viasd bench run is writing it (lock {lock_path(out)}); "
                              "wait for it to finish, or choose another --out")
    _held[key] = [fd, 1]
    try:
        yield
    finally:
        del _held[key]
        os.close(fd)  # releases the lock (the lock file stays: removing it would race a third run)


def done_keys(out: Path) -> set[tuple[str, str, str]]:
    """Records already written (a torn or malformed line is simply redone)."""
    return {(r["task"], r["prompt_id"], r["method"]) for r in read_records(out)[0]}


def drop_torn_tail(out: Path) -> None:
    """A killed run can leave half a line at the end: cut it off (it is redone), so the file stays
    one JSON record per line for `viasd report`."""
    if not out.exists() or out.stat().st_size == 0:
        return
    with open(out, "rb+") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(max(0, size - 1))
        if f.read(1) == b"\n":
            return
        pos, chunk = size, 1 << 16
        while pos > 0:  # find the last newline
            start = max(0, pos - chunk)
            f.seek(start)
            i = f.read(pos - start).rfind(b"\n")
            if i != -1:
                f.truncate(start + i + 1)
                return
            pos = start
        f.truncate(0)


def pass_costs(model, base: GenerateConfig) -> dict | None:
    """A model's measured pass times for the time cost model (`report.cost_model`): seconds of a pass
    of 1 .. R rows (R: the most a round of these settings verifies, + 1; medians of 9 rounds, since one
    slow spell in 3 skews every prediction; measured here, not the draft-length policy's times, which
    requests have learnt into), and its full pass' weight bytes (None for models that do not count
    bytes: T5)."""
    from viasd.execution.timing import pass_times

    dec = model.decoder
    if dec.is_encoder_decoder or not hasattr(dec, "weight_bytes"):
        return None
    rows = max(base.k, base.viasd.full_block) + 2
    return {"rows_s": [round(t, 6) for t in pass_times(dec, rows, reps=9, keep=False)], "full_pass_bytes": dec.weight_bytes()}


@compute.owned
def run_bench(model, drafter, methods: list[tuple[str, dict]], prompts: list[Prompt], out: Path,
              base: GenerateConfig, progress: bool = True) -> int:
    """Run every (prompt, method) not yet in `out`; return how many records were written. `out`
    must be a results file or absent, and is locked against a second run for the whole run.
    `drafter`: None, a model, or {name: model} (a method `...@name` drafts with that one; the others
    with the first)."""
    check_results_file(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with results_lock(out):
        return _run_bench(model, drafter, methods, prompts, out, base, progress)


def _run_bench(model, drafter, methods, prompts, out, base, progress) -> int:
    from tqdm import tqdm

    done = done_keys(out)
    todo = [(p, m) for p in prompts for m in methods if (p.task, p.id, m[0]) not in done]
    if not todo:
        return 0
    env = environment()
    # one id per invocation: a resumed file holds several runs, which a comparison must not mix
    run_id = time.strftime("%Y%m%dT%H%M%S") + "-" + os.urandom(3).hex()
    drafters = drafter if isinstance(drafter, dict) else {drafter.name: drafter} if drafter is not None else {}
    chosen, available, settings_of = _methods_here(methods, drafters)
    # warm-up, every method once: first calls build graphs, and --adapt-k measures its pass costs once per model
    for name, _ in methods:
        if not available[name]:
            generate("Hello", model, drafter=chosen[name], config=base.replace(**settings_of[name], max_new_tokens=4), progress=False)
    costs = {id(m): pass_costs(m, base) for m in [model, *drafters.values()]}
    out.parent.mkdir(parents=True, exist_ok=True)
    bar = tqdm(total=len(todo), desc="bench", disable=not progress, file=sys.stderr)
    speedups: list[float] = []
    ar_speed: dict[tuple[str, str], float] = {}
    written = 0
    drop_torn_tail(out)  # a killed run left half a line
    with open(out, "a") as f:
        for prompt, (name, _) in todo:
            settings, drafter = settings_of[name], chosen[name]
            median = f", speed-up {sorted(speedups)[len(speedups) // 2]:.2f}x" if speedups else ""
            bar.set_postfix_str(f"{name} on {prompt.task}/{prompt.id}" + median)
            record = {"task": prompt.task, "prompt_id": prompt.id, "method": name, "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                      "run_id": run_id, "weights": {"model": model.weights, "drafter": drafter.weights if drafter else None},
                      "kernels": {"model": model.kernels, "drafter": drafter.kernels if drafter else None},
                      "pass_costs": {"verifier": costs[id(model)], "drafter": costs[id(drafter)] if drafter else None}}
            if available[name]:
                record["unavailable"] = available[name]
            else:
                config = base.replace(**settings, chat=prompt.chat if prompt.chat is not None else base.chat)
                record.update(_decode(prompt, model, drafter, config))
                tps = record["stats"]["tokens_per_s"]
                if name == BASELINE:
                    ar_speed[(prompt.task, prompt.id)] = tps
                elif (prompt.task, prompt.id) in ar_speed and ar_speed[(prompt.task, prompt.id)] > 0:
                    speedups.append(tps / ar_speed[(prompt.task, prompt.id)])
            record["env"] = env
            f.write(dumps_strict(record) + "\n")  # strict JSON: inf -> "inf", NaN -> null
            f.flush()
            os.fsync(f.fileno())
            written += 1
            bar.update(1)
    bar.close()
    return written


def _methods_here(methods, drafters: dict) -> tuple[dict, dict, dict]:
    """Per method name: its drafter, why it cannot run here (None: it can; such methods are
    reported, not faked), and its settings without the drafter's name."""
    chosen, available, settings_of = {}, {}, {}
    for name, settings in methods:
        chosen[name], available[name] = drafter_of(settings, drafters)
        settings_of[name] = {k: v for k, v in settings.items() if k != "drafter"}
    return chosen, available, settings_of


def _decode(prompt: Prompt, model, drafter, config: GenerateConfig) -> dict:
    """A record's fields for one decode of `prompt` (both turns of a two-turn prompt): text, tokens,
    stats, config and quality."""
    record: dict[str, Any] = {}
    r = generate(prompt.text, model, drafter=drafter, config=config, progress=False)
    stats = r.stats
    if prompt.follow_up is not None:  # the second turn answers after the model's own first answer
        turn1 = r
        conversation = [{"role": "user", "content": prompt.text}, {"role": "assistant", "content": turn1.text},
                        {"role": "user", "content": prompt.follow_up}]
        r = generate(conversation, model, drafter=drafter, config=config, progress=False)
        stats = turn1.stats.merge(r.stats)
        record.update(turns=[{"text": t.text, "token_ids": t.token_ids, "stats": t.stats.to_dict()} for t in (turn1, r)])
    text = humaneval_completion(r.text) if prompt.task == "human_eval" else r.text
    record.update(text=text, token_ids=r.token_ids, stats=stats.to_dict(), config=r.config,
                  quality=score(prompt.task, r.text, prompt.reference, prompt.problem, prompt.metric))
    return record
