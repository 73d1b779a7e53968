"""DIMR route search: random search, then Bayesian optimisation (Optuna TPE), over layer masks under
a compute budget, minimising a KL-type cost between the full model and the routed model.

Calibration (calibration.py): Spec-Bench dev prompts (question_id % 5 == 0; the rest stay for evaluation) continued
greedily by the full model to `seq_len` tokens. The full model's next-token distributions on the
continuation are cached once (top-k log-probs + the remaining mass), so a trial costs one routed,
teacher-forced pass per sequence: the prompt's K/V comes from the full model (n_full = prompt
length - 1), the routed pass covers the continuation, as a slim verifier sees it while decoding.

Cost with top-k: KL between the distributions coarsened to {top-k tokens of p, everything else}
(a lower bound of the full KL, exact when the rest has no mass).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from viasd import compute
from viasd.errors import UsageError
from viasd.models.kvcache import LayerMask
from viasd.models.loading import LoadedModel, same_vocabulary
from viasd.routing.calibration import Calibration, build_calibration, dev_prompts, greedy_continuation  # noqa: F401 (re-exported)
from viasd.routing.route import ModelFingerprint, Route
from viasd.routing.vocab import calibration_vocab, coverage
from viasd.validation import check_choice, check_float, check_int, check_seed, check_writable_file, lock_beside

COSTS = ("kl", "reverse_kl", "tv")
# the same costs over the positions where a drafter's greedy token is wrong (`drafter_misses`): the
# slim verifier's job when it rescues a weak drafter (search_route(..., misses=...))
RESCUE_COSTS = tuple(f"{c}_where_drafter_wrong" for c in COSTS)
BUDGET_UNITS = ("layers", "bytes")  # what --budget is a share of: the layers, or a full pass' weight bytes


def check_settings(budget, trials, n_random, seed, calib_seqs, calib_len, cost) -> None:
    """`viasd search`'s settings, checked before any model loads or calibration is built."""
    check_choice("cost", cost, COSTS + RESCUE_COSTS)
    check_float("--budget", budget, 0.0, 1.0, lo_open=True)
    check_int("--trials", trials, 1, 1_000_000)
    check_int("--random-trials", n_random, 0, 1_000_000)
    check_seed(seed, "seed", 2**32 - 1)  # Optuna's sampler takes a 32-bit seed
    check_int("--calib-seqs", calib_seqs, 1, 10_000)
    check_int("--calib-len", calib_len, 4, 1 << 16)


def open_storage(url: str | None):
    """The Optuna storage for `url` (None: in memory). A SQLite file is checked writable up front, and
    one that is not a readable Optuna database is moved aside (kept, never deleted) and started afresh.
    Creation and that check run under an flock on DB.lock: a second search starting the same new
    database waits for the first to create it, then opens it (it never moves aside a database being made)."""
    if url is None:
        return None
    path = Path(url[len("sqlite:///"):]) if url.startswith("sqlite:///") else None
    if path is None:
        return _open_rdb(url, None)
    check_writable_file(path, "Optuna database")
    with storage_lock(path):  # two searches starting the same new database: one creates it, the other then opens it
        return _open_rdb(url, path)


# how long a search waits for another one to finish creating (or checking) the same SQLite database
STORAGE_LOCK_WAIT_S = 120.0


def storage_lock_path(path: Path) -> Path:
    return path.with_name(path.name + ".lock")


@contextmanager
def storage_lock(path: Path, wait_s: float | None = None) -> Iterator[None]:
    """An exclusive flock on DB.lock (beside the database) around its creation and validation."""
    fd = lock_beside(path, "Optuna database", STORAGE_LOCK_WAIT_S if wait_s is None else wait_s)
    if fd is None:
        raise UsageError(f"Optuna database {path}: another search has held {storage_lock_path(path)} for over "
                         f"{STORAGE_LOCK_WAIT_S:.0f} s; try again when it is done")
    try:
        yield
    finally:
        os.close(fd)  # releases the lock


def _open_rdb(url: str, path: Path | None):
    import optuna

    try:
        storage = optuna.storages.RDBStorage(url)
        storage.get_all_studies()
        return storage
    except Exception as e:  # sqlalchemy / optuna errors on a damaged or foreign database
        why = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:120]}"
        if path is None or not path.exists():
            raise UsageError(f"cannot open Optuna storage {url} ({why})") from None
        if "locked" in str(e).lower() or "busy" in str(e).lower():  # another search writing it now: not damaged
            raise UsageError(f"Optuna database {path} is busy (another search is writing it: {why}); try again later") from None
    aside = path.with_name(f"{path.name}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}")
    os.replace(path, aside)
    print(f"viasd: {path} is not a readable Optuna database; moved it to {aside} and starting the study again", file=sys.stderr)
    return optuna.storages.RDBStorage(url)


def coarse_divergences(full_logp: torch.Tensor, idx: torch.Tensor, routed_logits: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-position divergences between p (full, top-k known) and q (routed, all known).

    full_logp, idx: [N, k]; routed_logits: [N, V]. Returns {cost: [N]} and top-1 agreement [N].
    """
    q_logp_all = torch.log_softmax(routed_logits.float(), -1)
    q_logp = q_logp_all.gather(-1, idx)  # [N, k]
    p, q = full_logp.exp(), q_logp.exp()
    p_rest = (1 - p.sum(-1)).clamp_min(1e-12)  # [N]
    q_rest = (1 - q.sum(-1)).clamp_min(1e-12)
    kl = (p * (full_logp - q_logp)).sum(-1) + p_rest * (p_rest.log() - q_rest.log())
    rkl = (q * (q_logp - full_logp)).sum(-1) + q_rest * (q_rest.log() - p_rest.log())
    tv = 0.5 * ((p - q).abs().sum(-1) + (p_rest - q_rest).abs())
    agree = (q_logp_all.argmax(-1) == idx[:, 0]).float()
    return {"kl": kl, "reverse_kl": rkl, "tv": tv, "top1_agreement": agree}


def evaluate_route(model: LoadedModel, calib: Calibration, mask: LayerMask | None) -> dict[str, float]:
    """Mean divergences and top-1 agreement of the routed model against the cached full model (and,
    with `calib.misses`, the same over the positions where the drafter is wrong)."""
    totals: dict[str, float] = {}
    count = missed = 0
    for i, (seq, plen, logp, idx) in enumerate(zip(calib.sequences, calib.prompt_lens, calib.topk_logp, calib.topk_idx)):
        key = (id(model.decoder), i)
        cache = calib._prompt_caches.get(key)
        if cache is None:  # the full model's prompt K/V, computed once per sequence
            cache = calib._prompt_caches[key] = model.decoder.new_cache(len(seq))
            if plen > 1:
                model.decoder.forward(seq[: plen - 1], 0, cache, last_only=True)
        cache.rollback(plen - 1)  # forget the previous trial's routed (or full) continuation
        logits = model.decoder.forward(seq[plen - 1 : -1], plen - 1, cache, route=mask)
        wrong = calib.misses[i] if calib.misses is not None else None
        for name, values in coarse_divergences(logp, idx, logits).items():
            totals[name] = totals.get(name, 0.0) + float(values.sum())
            if wrong is not None:
                rescue = f"{name}_where_drafter_wrong"
                totals[rescue] = totals.get(rescue, 0.0) + float(values[wrong].sum())
        count += logits.shape[0]
        missed += int(wrong.sum()) if wrong is not None else 0
    out = {}
    for name, total in totals.items():
        n = missed if name.endswith("_where_drafter_wrong") else count
        out[name] = total / n if n else 0.0
    return out


def drafter_misses(verifier: LoadedModel, drafter: LoadedModel, calib: Calibration) -> list[torch.Tensor]:
    """Per calibration sequence, [L - P] bool: where `drafter`, teacher-forced on the sequence's text,
    does not predict the full model's next token. A drafter of another vocabulary reads the text in
    its own tokens (`models.vocabulary`); at a position where the next verifier token starts, its
    greedy token among the tokens both vocabularies share is mapped to the verifier's; where no
    drafter token ends there it counts as wrong (it cannot propose that token as it stands)."""
    from viasd.models.vocabulary import VocabBridge

    bridge = None if same_vocabulary(verifier, drafter) else VocabBridge(verifier.vocabulary, drafter.vocabulary)
    out = []
    for seq, plen in zip(calib.sequences, calib.prompt_lens):
        ids = seq.tolist()
        truth = torch.tensor(ids[plen:])  # [L - P] the tokens positions plen-1 .. L-2 predict
        if bridge is None:
            logits = drafter.decoder.forward(seq[:-1], 0, drafter.decoder.new_cache(len(seq)))[plen - 1 :]
            out.append(logits.argmax(-1) != truth)
            continue
        v, d = bridge.verifier, bridge.drafter
        ends, e = [], 0
        for t in ids:
            e += len(v.pieces[t])
            ends.append(e)
        d_ids = d.encode(v.text_bytes(ids).decode("utf-8", errors="replace"))
        at, e = {}, 0
        for m, t in enumerate(d_ids):  # drafter position m ends at byte e
            e += len(d.pieces[t])
            at[e] = m
        head = drafter.decoder.reduced_head(bridge.shared)
        logits = drafter.decoder.forward(torch.tensor(d_ids), 0, drafter.decoder.new_cache(len(d_ids)), head=head)
        guess = bridge.to_verifier[logits.argmax(-1)]  # [len(d_ids)] verifier ids
        wrong = torch.ones(len(truth), dtype=torch.bool)
        for j in range(plen - 1, len(ids) - 1):
            pos = at.get(ends[j])
            if pos is not None:
                wrong[j - plen + 1] = int(guess[pos]) != ids[j + 1]
        out.append(wrong)
    return out


def evaluate_model(other: LoadedModel, calib: Calibration) -> dict[str, float]:
    """Divergences of an independent model (same vocabulary) from the calibration's full model:
    the paper's ablation of a routed slim verifier against a separate smaller model."""
    totals: dict[str, float] = {}
    count = 0
    for seq, plen, logp, idx in zip(calib.sequences, calib.prompt_lens, calib.topk_logp, calib.topk_idx):
        cache = other.decoder.new_cache(len(seq))
        logits = other.decoder.forward(seq[:-1], 0, cache)[plen - 1 :]
        for name, values in coarse_divergences(logp, idx, logits).items():
            totals[name] = totals.get(name, 0.0) + float(values.sum())
        count += logits.shape[0]
    return {name: total / count for name, total in totals.items()}


def kept_from_scores(scores: dict[int, float], n_keep: int, pinned: list[int]) -> list[int]:
    """The pinned layers plus the highest-scoring free ones, n_keep in all."""
    free = sorted(scores, key=lambda i: -scores[i])[: max(n_keep - len(pinned), 0)]
    return sorted(set(pinned) | set(free))


def kept_within_bytes(scores: dict[int, float], pinned: list[int], sizes: list[int], capacity: float) -> list[int]:
    """The pinned layers plus free ones in order of score, each that still fits: at most `capacity`
    bytes of layer weights in all (`sizes[i]`: layer i's)."""
    kept, used = list(pinned), sum(sizes[i] for i in pinned)
    for i in sorted(scores, key=lambda i: -scores[i]):
        if used + sizes[i] <= capacity:
            kept.append(i)
            used += sizes[i]
    return sorted(kept)


def route_costs(model: LoadedModel, mask: LayerMask, vocab: tuple[int, ...] | None = None) -> dict[str, float]:
    """What a pass along `mask` reads, as a fraction of a full pass' weight bytes (its kept layers and
    its head: the reduced one over `vocab`, else the full one), and what a full pass resumed after it
    reads (the layers from its prefix on, and the full head)."""
    dec = model.decoder
    full = dec.weight_bytes()
    head = dec.reduced_head(vocab) if vocab else True
    return {"weight_bytes_fraction": dec.weight_bytes(mask, head=head) / full,
            "resumed_full_fraction": dec.weight_bytes(None, from_layer=mask.prefix) / full}


@contextmanager
def _optuna_verbosity(level: int) -> Iterator[None]:
    import optuna

    previous = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(level)
    try:
        yield
    finally:
        optuna.logging.set_verbosity(previous)


@compute.owned
def search_route(
    model: LoadedModel,
    budget: float,
    trials: int,
    seed: int = 0,
    storage: str | None = None,
    cost: str = "kl",
    pin_ends: bool = True,
    calib: Calibration | None = None,
    n_random: int = 20,
    progress: bool = True,
    prefix: int = 0,
    head_vocab: int | None = None,
    budget_unit: str = "layers",
    rescue_of: str | None = None,
) -> Route:
    """Run (or resume) a DIMR study; return the best route found. `trials` is the study's total.

    `budget_unit`: "layers", the share of layers kept; or "bytes", the share of a full pass' weight
    bytes the slim pass reads, its LM head included (the reduced one with `head_vocab`): layers are
    then kept in order of score while they fit.
    `prefix`: layers 0 .. prefix-1 are kept whole (a resumable route: full passes start at layer
    `prefix` after its slim passes; see `KVCache.enable_resume`), the search chooses the rest.
    `head_vocab`: store a reduced LM head of about that many tokens with the route (routing/vocab.py),
    with the share of calibration positions whose full-model top-1 token it holds.
    `rescue_of`: the drafter whose misses `calib.misses` holds (a `RESCUE_COSTS` cost weighs them; the
    study's name says which drafter)."""
    _check_search(model, budget, trials, n_random, seed, cost, budget_unit)
    if isinstance(storage, str):
        storage = open_storage(storage)
    n = model.config.n_layers
    n_keep = max(1, round(budget * n))
    pinned = _pinned_layers(n, n_keep, prefix, pin_ends, budget_unit)
    calib = calib or build_calibration(model, progress=progress)
    if cost in RESCUE_COSTS and calib.misses is None:
        raise UsageError(f"cost {cost!r} needs a drafter whose misses it weighs (--rescue-drafter)")
    # the reduced head's vocabulary depends on the calibration only, not on the route
    vocab = calibration_vocab(model, head_vocab, calib) if head_vocab is not None else None
    select, unit = _selector(model, budget, budget_unit, n_keep, pinned, vocab)
    free = [i for i in range(n) if i not in pinned]
    fp = ModelFingerprint.of(model)
    name = (f"dimr-{fp.source}-{fp.n_layers}-b{budget}{unit}-{cost}-s{seed}-pin{int(pin_ends)}"
            f"{f'-prefix{prefix}' if prefix else ''}{f'-rescue-{rescue_of}' if rescue_of else ''}-{calib.description}")
    study, t0 = _run_study(model, calib, name, storage, trials, n_random, seed, free, select, cost, f"DIMR budget {budget}", progress)
    search = {"method": "DIMR: random warm start + Optuna TPE", "seed": seed, "trials": None, "random_trials": n_random,
              "pinned": pinned, "budget_unit": budget_unit, "calibration": calib.description, "rescue_of": rescue_of,
              "time_s": None, "this_run_s": None, "study": name}
    return _best_route(model, fp, study, calib, vocab, cost, budget, search, t0)


def _check_search(model: LoadedModel, budget, trials, n_random, seed, cost, budget_unit) -> None:
    if cost not in COSTS + RESCUE_COSTS:
        raise UsageError(f"unknown cost {cost!r}: choose from {', '.join(COSTS + RESCUE_COSTS)}")
    if not 0 < budget <= 1:
        raise UsageError(f"budget must be in (0, 1], got {budget}")
    if trials < 1:
        raise UsageError(f"trials must be >= 1, got {trials}")
    if model.decoder.is_encoder_decoder:
        raise UsageError(f"{model.name}: DIMR search calibrates on decoder-only text; give an encoder-decoder "
                         "model's decoder route as layers (--slim-layers, --draft-layers) or a route file")
    check_settings(budget, trials, n_random, seed, 1, 4, cost)
    check_choice("--budget-unit", budget_unit, BUDGET_UNITS)


def _pinned_layers(n: int, n_keep: int, prefix: int, pin_ends: bool, budget_unit: str) -> list[int]:
    """The layers every route keeps: the first and last (`pin_ends`) and the resumable prefix."""
    if budget_unit == "layers":
        if not 0 <= prefix < n or prefix > n_keep:
            raise UsageError(f"--prefix must be in 0 .. {min(n - 1, n_keep)} (the budget keeps {n_keep} of {n} layers), got {prefix}")
        return sorted(({0, n - 1} if pin_ends and n_keep >= 2 else set()) | set(range(prefix)))[:n_keep]
    if not 0 <= prefix < n:
        raise UsageError(f"--prefix must be in 0 .. {n - 1}, got {prefix}")
    return sorted(({0, n - 1} if pin_ends else set()) | set(range(prefix)))


def _selector(model: LoadedModel, budget: float, budget_unit: str, n_keep: int, pinned: list[int], vocab):
    """How a trial's layer scores become the kept layers under the budget, and the study name's unit tag."""
    if budget_unit == "layers":
        return (lambda scores: kept_from_scores(scores, n_keep, pinned)), ""
    dec, n = model.decoder, model.config.n_layers
    sizes = [dec.weight_bytes(LayerMask.from_layers(n, [i]), head=False) for i in range(n)]
    full = dec.weight_bytes()
    head_bytes = dec.weight_bytes(LayerMask.from_layers(n, []), head=dec.reduced_head(vocab) if vocab else True)
    capacity = budget * full - head_bytes
    if sum(sizes[i] for i in pinned) > capacity:
        raise UsageError(f"a budget of {budget} of a full pass' {full / 2**20:.1f} MB cannot hold the LM head "
                         f"({head_bytes / 2**20:.1f} MB) and the pinned layers {pinned} "
                         f"({sum(sizes[i] for i in pinned) / 2**20:.1f} MB)")
    return (lambda scores: kept_within_bytes(scores, pinned, sizes, capacity)), f"-bytes-v{len(vocab) if vocab else 'full'}"


def _run_study(model: LoadedModel, calib: Calibration, name: str, storage, trials: int, n_random: int, seed: int,
               free: list[int], select, cost: str, desc: str, progress: bool):
    """Create or resume the Optuna study `name` and run it to `trials` complete trials; returns the study
    and when this run's trials began (time.perf_counter())."""
    import optuna
    from optuna.trial import TrialState
    from tqdm import tqdm

    n = model.config.n_layers
    with _optuna_verbosity(optuna.logging.WARNING):  # the caller's logging setting is restored after
        sampler = optuna.samplers.TPESampler(n_startup_trials=n_random, seed=seed, multivariate=True)
        study = optuna.create_study(study_name=name, storage=storage, direction="minimize", sampler=sampler, load_if_exists=True)
        for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            study.tell(t.number, state=TrialState.FAIL)  # left running by an interrupted run
        done = len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)))
        memo: dict[tuple[int, ...], dict] = {
            tuple(t.user_attrs["kept"]): t.user_attrs["metrics"] for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        }
        t0 = time.perf_counter()
        bar = tqdm(total=trials, initial=done, desc=desc, disable=not progress, file=sys.stderr)

        def objective(trial: optuna.Trial) -> float:
            scores = {i: trial.suggest_float(f"layer_{i}", 0.0, 1.0) for i in free}
            kept = select(scores)
            key = tuple(kept)
            if key not in memo:
                memo[key] = evaluate_route(model, calib, LayerMask.from_layers(n, kept))
            trial.set_user_attr("kept", kept)
            trial.set_user_attr("metrics", memo[key])
            return memo[key][cost]

        def report(study: optuna.Study, trial) -> None:
            bar.update(1)
            bar.set_postfix(best=f"{study.best_value:.4f}")

        if trials > done:
            study.optimize(objective, n_trials=trials - done, callbacks=[report])
    bar.close()
    return study, t0


def _best_route(model: LoadedModel, fp: ModelFingerprint, study, calib: Calibration, vocab, cost: str, budget: float,
                search: dict, t0: float) -> Route:
    """The study's best trial as a Route: its metrics and costs, and `search` (how it was found) with its times."""
    from optuna.trial import TrialState

    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    study_s = sum((t.datetime_complete - t.datetime_start).total_seconds() for t in complete)
    best = study.best_trial
    kept = best.user_attrs["kept"]
    metrics = {**best.user_attrs["metrics"], "cost": cost}
    if vocab is not None:
        metrics["vocab_size"] = len(vocab)
        metrics["vocab_top1_coverage_calibration"] = coverage(vocab, torch.cat([idx[:, 0] for idx in calib.topk_idx]).tolist())
    mask = LayerMask.from_layers(model.config.n_layers, kept)
    metrics.update({k: round(v, 4) for k, v in route_costs(model, mask, vocab).items()})
    search.update(trials=len(complete), time_s=round(study_s, 1), this_run_s=round(time.perf_counter() - t0, 1))
    return Route.from_layers(fp, kept, budget=budget, vocab=vocab, metrics=metrics, search=search)
