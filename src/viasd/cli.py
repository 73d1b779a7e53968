"""`viasd` console script: one command table, each command a thin front end over the API."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

from viasd.errors import UsageError, ViasdError
from viasd.validation import DRAFTER_FORMATS, DRAFTER_REQUANT, WEIGHT_FORMATS

DEMO_PROMPT = "Explain in three sentences why the sky is blue."
BENCH_EXTRA = ("optuna", "sacrebleu", "rouge_score", "matplotlib")  # what `pip install 'viasd[bench]'` adds (pyproject.toml)


def read_stdin(what: str) -> bytes:
    """Standard input, at most MAX_INPUT_BYTES of it; closed or unreadable stdin is a usage error."""
    from viasd.errors import InvalidPromptError
    from viasd.validation import MAX_INPUT_BYTES

    if sys.stdin is None or getattr(sys.stdin, "buffer", None) is None:
        raise InvalidPromptError(f"'-' reads {what} from standard input, which is closed")
    try:
        data = sys.stdin.buffer.read(MAX_INPUT_BYTES + 1)
    except (OSError, ValueError) as e:  # a closed descriptor, a directory, ...
        raise InvalidPromptError(f"'-' reads {what} from standard input, which cannot be read ({e})") from None
    if len(data) > MAX_INPUT_BYTES:
        raise InvalidPromptError(f"{what} on standard input is larger than {MAX_INPUT_BYTES >> 20} MiB")
    return data


def _generate(args: argparse.Namespace) -> int:
    from viasd.api import GenerateConfig, generate, preflight_files
    from viasd.models.loading import load_drafter, load_model
    from viasd.settings import from_args
    from viasd.validation import check_device, check_text, decode_utf8, dumps_strict

    prompt = DEMO_PROMPT if args.prompt is None else check_text("the prompt", args.prompt)
    if prompt == "-":
        prompt = decode_utf8(read_stdin("the prompt"), "the prompt on stdin")
    config = GenerateConfig.from_settings(**from_args(args))
    config.validate()  # before any model is fetched
    check_device(args.device)
    preflight_files(config.flat())
    progress = not args.quiet
    model = load_model(args.model, weights=args.weights, device=args.device, progress=progress)
    drafter = (load_drafter(args.drafter, args.weights, args.drafter_weights, args.device, progress)
               if args.drafter else None)

    def emit(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    result = generate(prompt, model, drafter=drafter, config=config, on_text=None if args.json else emit, progress=progress)
    if args.json:
        print(dumps_strict(result.to_dict()))  # strict JSON: inf -> "inf", NaN -> null
        return 0
    s = result.stats.to_dict()
    print()
    calls = ", ".join(f"{k} {v}" for k, v in s["calls"].items())
    # the rate after the first token beside the whole call's: a speculative strategy measures its pass
    # costs before the first token, which a short answer's overall rate would charge to its decoding
    then = f"; first token after {s['first_token_s']:.2f} s, then {s['decode_tokens_per_s']:.1f} tok/s" \
        if s.get("first_token_s") is not None and s.get("decode_tokens_per_s") else ""
    print(
        f"[{config.spec.label(config.viasd.mode)}] {s['new_tokens']} tokens in {s['wall_s']:.2f} s ({s['tokens_per_s']:.1f} tok/s{then}), "
        f"mean accepted length {s['mean_accepted_length']:.2f}, rejection rate {s['rejection_rate']:.2f}, calls: {calls}",
        file=sys.stderr,
    )
    return 0


def _models(args: argparse.Namespace) -> int:
    from viasd.models.cache import check_cache_path
    from viasd.models.convert import cached_models, verify_cache
    from viasd.models.download import zoo_gguf_path
    from viasd.models.config import FAMILIES, FAMILY_SUPPORT, SUPPORTED_ARCHITECTURES
    from viasd.models.zoo import DEFAULT_MODEL, ZOO

    check_cache_path()  # a cache path that is a file: one line, exit 2, as `generate` says it
    if args.verify:
        results = verify_cache()
        for entry, why in results:
            print(f"{'ok' if why is None else 'DAMAGED, removed (rebuilt on next use)'}  {entry}" + (f": {why}" if why else ""))
        damaged = sum(why is not None for _, why in results)
        print(f"{len(results)} cache entr{'y' if len(results) == 1 else 'ies'} checked, {damaged} damaged")
        return 1 if damaged else 0
    cached = {m.get("source"): m for m in cached_models() if not m.get("damaged")}
    rows = []
    for alias, e in ZOO.items():
        state = "converted" if alias in cached else ("downloaded" if zoo_gguf_path(e).exists() else "-")
        if e.architecture not in SUPPORTED_ARCHITECTURES:
            state += " (architecture not supported yet)"
        rows.append((alias + (" (default)" if alias == DEFAULT_MODEL else ""), e.architecture, f"{e.size_mb} MB", state, e.description))
    if args.json:
        print(json.dumps([dict(zip(("alias", "architecture", "download", "cache", "description"), r),
                               family=FAMILIES.get(ZOO[r[0].split(" ")[0]].architecture)) for r in rows], allow_nan=False))
        return 0
    widths = [max(len(r[i]) for r in rows + [("alias", "arch", "download", "cache", "")]) for i in range(4)]
    print("  ".join(h.ljust(w) for h, w in zip(("alias", "arch", "download", "cache"), widths)) + "  model")
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[4])
    others = [m for m in cached_models() if m.get("source") not in ZOO]
    for m in others:
        if m.get("damaged"):
            print(f"damaged: {m['dir']} ({m['damaged']}); rebuilt on its next load (or run `viasd models --verify`)")
        else:
            print(f"also cached: {m['source']} ({m['size_mb']} MB) in {m['dir']}")
    print("\nfamilies (any checkpoint of these architectures: a GGUF file, a transformers directory, a hub id)")
    for family, (archs, runtime, runs) in FAMILY_SUPPORT.items():
        print(f"  {family}: {archs}\n    runtime: {runtime}\n    supports: {runs}")
    return 0


def _routes_show(args: argparse.Namespace) -> int:
    from viasd.routing import Route

    route = Route.load(args.route)
    m = route.model
    print(f"{args.route}: route for {m.source} ({m.architecture}, {m.n_layers} layers)")
    print(f"  layers  {route.picture()}   (█ kept, a attention only, m MLP only, · skipped)")
    print(f"  kept    {len(route.kept_layers)}/{m.n_layers} layers, {route.fraction:.0%} of sub-layer work"
          + (f" (budget {route.budget:.2f})" if route.budget is not None else ""))
    if route.mask.prefix:
        print(f"  resumes full passes at layer {route.mask.prefix} (layers 0..{route.mask.prefix - 1} kept whole)")
    if route.vocab is not None:
        print(f"  head    reduced: {len(route.vocab)} tokens (ids {route.vocab[0]}..{route.vocab[-1]})")
    for key, value in route.metrics.items():
        print(f"  {key:<15} {value:.4g}" if isinstance(value, float) else f"  {key:<15} {value}")
    for key, value in route.search.items():
        print(f"  search.{key} = {value}")
    return 0


def _routes_vocab(args: argparse.Namespace) -> int:
    import dataclasses

    import torch

    from viasd.models.loading import load_model
    from viasd.routing import Route
    from viasd.routing.route import ModelFingerprint
    from viasd.routing.search import build_calibration
    from viasd.routing.vocab import calibration_vocab, coverage
    from viasd.validation import check_int, check_writable_file

    check_int("--size", args.size, 1, 1 << 24)
    route = Route.load(args.route)
    out = check_writable_file(args.out or args.route, "route file")
    model = load_model(args.model or route.model.source, progress=not args.quiet)
    route.check_model(ModelFingerprint.of(model))
    calib = build_calibration(model, progress=not args.quiet)
    vocab = calibration_vocab(model, args.size, calib)
    held = coverage(vocab, torch.cat([idx[:, 0] for idx in calib.topk_idx]).tolist())
    metrics = {**route.metrics, "vocab_size": len(vocab), "vocab_top1_coverage_calibration": held}
    dataclasses.replace(route, vocab=vocab, metrics=metrics).save(out)
    print(f"{out}: reduced head of {len(vocab)} tokens (holds the full model's top-1 token at {held:.1%} of calibration positions)")
    return 0


def _add_routes(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="routes_command", required=True, metavar="ACTION")
    show = sub.add_parser("show", help="draw a route's layer mask and print its metrics")
    show.add_argument("route", help="route JSON file")
    show.set_defaults(run=_routes_show)
    vocab = sub.add_parser("vocab", help="store a reduced LM head (the calibration corpus' N most frequent tokens) with a route")
    vocab.add_argument("route", help="route JSON file")
    vocab.add_argument("--size", type=int, required=True, metavar="N", help="tokens the head keeps (rounded up to 16)")
    vocab.add_argument("--model", "-m", help="the route's model (default: the one the route names)")
    vocab.add_argument("--out", "-o", help="route JSON to write (default: the route file itself)")
    vocab.add_argument("--quiet", "-q", action="store_true", help="no progress bars")
    vocab.set_defaults(run=_routes_vocab)


def _search(args: argparse.Namespace) -> int:
    from viasd.models.loading import check_cache_writable, load_drafter, load_model
    from viasd.routing.search import build_calibration, check_settings, drafter_misses, open_storage, search_route
    from viasd.validation import check_int, check_text, check_writable_file

    check_settings(args.budget, args.trials, args.random_trials, args.seed, args.calib_seqs, args.calib_len, args.cost)
    check_int("--prefix", args.prefix, 0, 4096)
    if args.cost.endswith("_where_drafter_wrong") and not args.rescue_drafter:
        raise UsageError(f"--cost {args.cost} needs --rescue-drafter (the drafter whose misses it weighs)")
    if args.head_vocab is not None:
        check_int("--head-vocab", args.head_vocab, 1, 1 << 24)
    out = check_writable_file(check_text("--out", args.out), "route file")  # all before the model and calibration
    storage = args.storage or f"sqlite:///{out.with_suffix('.optuna.sqlite').resolve()}"
    check_cache_writable()
    study_storage = open_storage(check_text("--storage", storage))
    progress = not args.quiet
    model = load_model(args.model, progress=progress)
    calib = build_calibration(model, n_seqs=args.calib_seqs, seq_len=args.calib_len, progress=progress)
    if args.rescue_drafter:
        calib.misses = drafter_misses(model, load_drafter(args.rescue_drafter, progress=progress), calib)
    route = search_route(model, args.budget, args.trials, seed=args.seed, storage=study_storage, cost=args.cost,
                         pin_ends=args.pin_ends, calib=calib, n_random=args.random_trials, progress=progress,
                         prefix=args.prefix, head_vocab=args.head_vocab, budget_unit=args.budget_unit,
                         rescue_of=args.rescue_drafter)
    route.save(out)
    print(f"{out}: {route.picture()}  {args.cost} {route.metrics[args.cost]:.4f}, "
          f"top-1 agreement {route.metrics['top1_agreement']:.3f}, reads {route.metrics['weight_bytes_fraction']:.2f} "
          f"of a full pass' weight bytes (a full pass resumed after it {route.metrics['resumed_full_fraction']:.2f})"
          + (f", top-1 agreement where the drafter is wrong {route.metrics['top1_agreement_where_drafter_wrong']:.3f}"
             if args.rescue_drafter else "") + f" (study in {storage})")
    return 0


def _add_search(p: argparse.ArgumentParser) -> None:
    from viasd.models.zoo import DEFAULT_MODEL
    from viasd.routing.search import COSTS, RESCUE_COSTS

    p.add_argument("--model", "-m", default=DEFAULT_MODEL, help="model to route (default: %(default)s)")
    p.add_argument("--budget", type=float, required=True,
                   help="fraction of layers kept (or, with --budget-unit bytes, of a full pass' weight bytes), e.g. 0.5")
    p.add_argument("--budget-unit", choices=("layers", "bytes"), default="layers",
                   help="layers: --budget is the share of layers kept; bytes: the share of a full pass' weight bytes "
                        "the slim pass reads, its LM head included (the reduced one with --head-vocab) (default: %(default)s)")
    p.add_argument("--trials", type=int, default=100,
                   help="the study's total trials; a rerun runs only the missing ones (default: %(default)s)")
    p.add_argument("--random-trials", type=int, default=20, help="random-search warm start before TPE (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cost", default="kl", choices=COSTS + RESCUE_COSTS,
                   help="KL(full||routed), reverse KL, or total variation, over every calibration position or "
                        "(..._where_drafter_wrong) over those where --rescue-drafter's greedy token is wrong (default: %(default)s)")
    p.add_argument("--rescue-drafter", metavar="MODEL",
                   help="a drafter model (any vocabulary): the route's metrics also count the positions where its "
                        "greedy token is wrong, the ones a slim verifier must rescue")
    p.add_argument("--pin-ends", action=argparse.BooleanOptionalAction, default=True,
                   help="always keep the first and last layer (default: on)")
    p.add_argument("--prefix", type=int, default=0, metavar="M",
                   help="keep layers 0..M-1 whole: full passes then resume at layer M after slim passes (default: %(default)s)")
    p.add_argument("--head-vocab", type=int, metavar="N",
                   help="store a reduced LM head of the N most frequent calibration tokens with the route (default: the full head)")
    p.add_argument("--calib-seqs", type=int, default=16, help="calibration sequences (default: %(default)s)")
    p.add_argument("--calib-len", type=int, default=128, help="tokens per calibration sequence (default: %(default)s)")
    p.add_argument("--out", "-o", required=True, help="route JSON to write")
    p.add_argument("--storage", help="Optuna storage URL (default: sqlite file beside --out)")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bars")


def _calibrate(args: argparse.Namespace) -> int:
    from viasd.api import GenerateConfig, preflight_files
    from viasd.calibrate import calibrate, check_settings, plot_curve, thresholds_path, write_thresholds
    from viasd.settings import from_args
    from viasd.routing.resolve import resolve_route
    from viasd.models.loading import load_drafter, load_model
    from viasd.routing.search import dev_prompts

    progress = not args.quiet
    base = GenerateConfig.from_settings(strategy="viasd", mode="tiered", slim_route=args.route, **from_args(args))
    base.validate()
    preflight_files(base.flat())
    check_settings(args.prompts, args.min_agreement)
    out = thresholds_path(args.out, args.route, args.model, args.correct)  # writable, checked before the minutes of work
    model = load_model(args.model, progress=progress)
    drafter = load_drafter(args.drafter, progress=progress) if args.drafter else None
    route_file = resolve_route(model, "slim", None, args.route).path
    prompts = dev_prompts(model, args.prompts)
    best, cands = calibrate(model, base, prompts, drafter, args.grid, args.min_agreement, progress)
    meta = {"model": args.model, "drafter": args.drafter or base.drafting.draft, "route": str(route_file) if route_file else "default",
            "min_agreement": None if args.correct else args.min_agreement, "correct": args.correct, "prompts": len(prompts),
            "max_new_tokens": args.max_new_tokens, "k": args.k}
    write_thresholds(out, best, cands, meta)
    png = plot_curve(out.with_suffix(".png"), best, cands, None if args.correct else args.min_agreement,
                     f"{args.model}: tiered thresholds{' (correction mode)' if args.correct else ''}")
    t = best.thresholds
    print(f"{out}: accept {t.accept}, accept_draft {t.accept_draft}, slim {t.slim}, draft_confident {t.draft_confident} "
          f"-> {best.tokens_per_s:.1f} tok/s, "
          f"agreement {best.agreement:.3f} (curve: {png})")
    return 0


def _add_calibrate(p: argparse.ArgumentParser) -> None:
    from viasd.calibrate import GRIDS
    from viasd.models.zoo import DEFAULT_MODEL
    from viasd.settings import add_arguments

    p.add_argument("--model", "-m", default=DEFAULT_MODEL, help="(default: %(default)s)")
    p.add_argument("--drafter", "-d", help="drafter model (else --draft pld or self)")
    add_arguments(p, only=("draft", "draft_route", "draft_conversion", "correct", "k", "max_new_tokens"), defaults={"max_new_tokens": 48})
    p.add_argument("--route", "-r", metavar="ROUTE.json", help="slim route (default: the shipped route); thresholds are written beside it")
    p.add_argument("--min-agreement", type=float, default=0.98,
                   help="quality constraint: share of committed tokens equal to the full model's greedy choice (default: %(default)s)")
    p.add_argument("--prompts", type=int, default=4, help="held-in calibration prompts (default: %(default)s)")
    p.add_argument("--grid", default="small", choices=list(GRIDS), help="threshold grid (default: %(default)s)")
    p.add_argument("--out", "-o", help="thresholds JSON (default: beside --route, else MODEL.slim.thresholds.json; "
                                       "with --correct, the correction mode's: ROUTE.correct.thresholds.json)")
    p.add_argument("--quiet", "-q", action="store_true")


def _bench(args: argparse.Namespace) -> int:
    from viasd.api import GenerateConfig, preflight_files
    from viasd.bench import check_results_file, load_tasks, parse_methods, results_lock, run_bench
    from viasd.models.loading import load_drafter, load_model
    from viasd.settings import from_args

    from viasd.validation import check_text, check_writable_file

    methods = parse_methods(args.methods)
    missing = sorted({m["drafter"] for _, m in methods if "drafter" in m} - set(args.drafter or []))
    if missing:
        raise UsageError(f"--methods names drafter(s) {', '.join(missing)} that no --drafter gives")
    prompts = load_tasks(args.tasks, args.limit, args.turns)
    base = GenerateConfig.from_settings(**from_args(args))
    base.validate()
    preflight_files(base.flat())
    out = check_results_file(check_writable_file(check_text("--out", args.out), "results file"))
    with results_lock(out):  # before the models load: a second run on the same file is refused at once
        progress = not args.quiet
        model = load_model(args.model, progress=progress)
        drafters = {}
        for name in dict.fromkeys(args.drafter or []):
            source, fmt = _drafter_format(name, args.drafter_weights)
            drafters[name] = load_drafter(source, drafter_weights=fmt, progress=progress)
        n = run_bench(model, drafters, methods, prompts, out, base, progress)
    print(f"{out}: {n} new record(s); {len(prompts) * len(methods)} in the run")
    return 0


def _drafter_format(name: str, default: str | None) -> tuple[str, str | None]:
    """A bench --drafter value MODEL or MODEL:FORMAT: (the model, its weights' format)."""
    model, _, fmt = name.rpartition(":")
    if model and fmt in DRAFTER_FORMATS:
        return model, fmt
    return name, default


def _add_bench(p: argparse.ArgumentParser) -> None:
    from viasd.bench import METHODS, TASKS
    from viasd.models.zoo import DEFAULT_MODEL
    from viasd.settings import add_arguments

    p.add_argument("--model", "-m", default=DEFAULT_MODEL, help="(default: %(default)s)")
    p.add_argument("--drafter", "-d", action="append", metavar="MODEL",
                   help="drafter model for sd (and cascade / viasd-*, which otherwise draft with a route or pld); "
                        "repeat it for several: a method METHOD@MODEL drafts with that one, the others with the first; "
                        "MODEL:FORMAT loads it in that --drafter-weights format (sd@MODEL:native,sd@MODEL:q4_0 compares them)")
    p.add_argument("--methods", default="ar,pld,self-sd,cascade,viasd-lossless,viasd-tiered",
                   help=f"comma-separated, from {', '.join(METHODS)}; cascade and viasd-* take :pld / :self / :model; sd, pld, "
                        "self-sd and cascade take +adapt / +fixed (draft lengths from measured costs or always --k; see --adapt-k); "
                        "any method takes +SETTING=VALUE for any setting of `viasd generate` (+k=8, +slim_layers=0/1/5); "
                        "a method drafting with a model takes @MODEL, one of the --drafter values (default: %(default)s)")
    p.add_argument("--tasks", default="spec_bench,human_eval", help=f"comma-separated, from {', '.join(TASKS)} (default: %(default)s)")
    p.add_argument("--limit", type=int, default=5, help="prompts per task (default: %(default)s)")
    p.add_argument("--turns", type=int, default=1, choices=(1, 2),
                   help="MT-bench: 1 = first question; 2 = a two-turn conversation (the second question follows the model's "
                        "own first answer; statistics cover both turns) (default: %(default)s)")
    add_arguments(p, only=("max_new_tokens", "k", "seed", "slim_route"))  # every method's, unless it sets its own
    p.add_argument("--out", "-o", default="results.jsonl",
                   help="JSONL results; rerunning skips records already there (default: %(default)s)")
    _add_drafter_weights(p, "native weights re-quantized to")
    p.add_argument("--quiet", "-q", action="store_true")


def _report(args: argparse.Namespace) -> int:
    from viasd.report import report
    from viasd.validation import check_text

    md, pngs = report(Path(check_text("results", args.results)), Path(check_text("--out", args.out)), args.run_id)
    print(md.read_text())
    print("plots: " + ", ".join(str(p) for p in pngs))
    return 0


def _add_report(p: argparse.ArgumentParser) -> None:
    p.add_argument("results", help="JSONL written by `viasd bench`")
    p.add_argument("--out", "-o", default="report", help="directory for report.md and the plots (default: %(default)s)")
    p.add_argument("--run", dest="run_id", metavar="ID", help="the bench run to report, when the file holds several (a resumed bench)")


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    """The models a command runs and how they load (generate's and serve's)."""
    from viasd.models.zoo import DEFAULT_MODEL

    p.add_argument("--model", "-m", default=DEFAULT_MODEL,
                   help="zoo alias, GGUF file, transformers directory or hub id (default: %(default)s)")
    p.add_argument("--drafter", "-d", help="drafter model for sd / cascade / viasd --draft model: any zoo model, GGUF or "
                   "directory; one with another tokenizer drafts through text or the tokens both share (--draft-conversion)")
    p.add_argument("--device", default="cpu", help="torch device (default: %(default)s)")
    p.add_argument("--weights", "--dtype", dest="weights", default="native", choices=WEIGHT_FORMATS,
                   help="native: the GGUF's own quantized weights through ggml's kernels (a model without a GGUF: its "
                        "float weights); float32: every weight dequantized, the exact reference; bfloat16 / float16: "
                        "half the bytes of float32 (default: %(default)s)")
    _add_drafter_weights(p, "the --weights format, native weights re-quantized to")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bars")


def _add_drafter_weights(p: argparse.ArgumentParser, default: str) -> None:
    p.add_argument("--drafter-weights", choices=DRAFTER_FORMATS, metavar="FORMAT",
                   help=f"the drafter's weights, one of {', '.join(DRAFTER_FORMATS)}: q4_0 re-quantizes "
                        "its native weights as they load, so its passes read fewer bytes; a drafter's precision changes "
                        f"how many drafts are accepted, never the output (default: {default} {DRAFTER_REQUANT})")


def _add_generate(p: argparse.ArgumentParser) -> None:
    from viasd.settings import add_arguments

    p.add_argument("prompt", nargs="?", help=f"text to continue; - reads stdin (default: {DEMO_PROMPT!r})")
    _add_model_flags(p)
    add_arguments(p)  # one flag per request setting (viasd/settings.py)
    p.add_argument("--json", action="store_true", help="print one JSON object (text, token_ids, stats, config) instead of streaming")


def _add_models(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--verify", action="store_true",
                   help="check everything a load trusts (every cached file's full sha256, the GGUF tensor indexes' checksums, "
                        "the compiled kernels'); remove damaged entries (rebuilt on next use); exit 1 if any")


def _add_serve(p: argparse.ArgumentParser) -> None:
    from viasd.server.run import add_arguments

    add_arguments(p, _add_model_flags)  # the requests' default settings and the server's own flags


def _serve(args: argparse.Namespace) -> int:
    from viasd.server.run import serve_command

    return serve_command(args)


# name -> (help, add arguments, run)
# (run None: the command has sub-actions that set their own)
COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int] | None]] = {
    "generate": ("generate text, streaming it, then print decoding statistics", _add_generate, _generate),
    "models": ("list zoo models and what is cached", _add_models, _models),
    "routes": ("inspect routes (layer masks of the verifier)", _add_routes, None),
    "bench": ("run methods x tasks, one resumable JSONL record per (prompt, method)", _add_bench, _bench),
    "report": ("Markdown table and plots from bench results", _add_report, _report),
    "calibrate": ("choose tiered-mode thresholds for speed under a quality constraint", _add_calibrate, _calibrate),
    "search": ("find a route by DIMR (random search, then Bayesian optimisation); resumable", _add_search, _search),
    "serve": ("serve an OpenAI-compatible HTTP API (completions, chat, streaming, /metrics); --replicas N on Ray Serve",
              _add_serve, _serve),
}


def build_parser() -> argparse.ArgumentParser:
    from viasd.version import __version__

    parser = argparse.ArgumentParser(prog="viasd", description="Multi-tier speculative decoding (VIA-SD).")
    parser.add_argument("--version", action="version", version=f"viasd {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (help_, add, run) in COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        add(p)
        if run is not None:
            p.set_defaults(run=run)
    return parser


def main(argv: list[str] | None = None) -> int:
    for stream in (sys.stdout, sys.stderr):  # text with undecodable bytes (surrogates) is escaped, never a traceback
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    args = build_parser().parse_args(argv)
    try:
        if args.command == "serve":  # its HTTP loop stays here; its decodes go to the compute thread
            return args.run(args)
        from viasd import compute

        return compute.run(args.run, args)  # model work on the process' one compute thread
    except ViasdError as e:
        print(f"viasd: error: {e}", file=sys.stderr)
        return e.exit_code
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] not in BENCH_EXTRA:
            raise
        print(f"viasd: error: viasd {args.command} needs {e.name}, which viasd[bench] installs: "
              "pip install 'viasd[bench]'", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nviasd: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `viasd ... | head`
        sys.stderr.close()
        return 1
    except OSError as e:  # a fault of the machine (disk full, I/O error), not of viasd: one line, no traceback
        print(f"viasd: error: {e.filename + ': ' if e.filename else ''}{e.strerror or e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
