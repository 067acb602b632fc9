"""One ``ortevals fidelity`` run: resolve the reference, stream the windows, summarize.

Owns the options at the boundary (:class:`FidelityOptions`), deciding what the
reference is (a GenAI package, a transformers checkpoint, or a saved reference
file), the checks that both sides see the same tokens (tokenizer hash, token
ids, window settings, vocabulary), and the printed and JSON report.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ortevals.errors import OrtEvalsError
from ortevals.fidelity import trajectories as tr
from ortevals.fidelity.positions import bucket_edges, check_threshold, format_lines, position_summary
from ortevals.fidelity.reference import SavedReference, load_reference, save_reference, tokenizer_hash
from ortevals.fidelity.stats import RefTokens, TokenStats, concat_stats, summarize
from ortevals.fidelity.windows import OrtSource, WindowPlan, compare_windows, plan_windows, reference_windows
from ortevals.files import check_writable_file
from ortevals.runtime.adapters import warn_base_model

log = logging.getLogger(__name__)
DEFAULT_TOKENS = 32768
DEFAULT_CTX = 512  # llama.cpp's perplexity default
POSITION_CTX = 4096  # --by-position's default window (at most the models' context)
DEFAULT_TOP_K = 128


@dataclass(frozen=True)
class FidelityOptions:
    pkg: Path | None
    ref: str | None
    text: Path | None = None
    data: str | None = None
    tokens: int | None = None  # None: DEFAULT_TOKENS, or what a reference file holds
    ctx: int | None = None
    top_k: int | None = None
    save_ref: Path | None = None
    json: Path | None = None
    ep: str | None = None
    by_position: bool = False  # every position scored, the breakdown by context length (fidelity/positions.py)
    buckets: tuple[int, ...] | None = None  # the buckets' inner edges (None: positions.DEFAULT_EDGES)
    kl_threshold: float | None = None  # the verdict's threshold, nats
    plot: Path | None = None  # the by-context-length plot (PNG)
    trajectories: Path | None = None  # a reference run whose generated outputs are followed (fidelity/trajectories.py)
    first: int | None = None  # --trajectories: the first N generated tokens of each output


@dataclass(frozen=True)
class FidelityReport:
    summary: dict
    stats: TokenStats = field(repr=False)
    clusters: np.ndarray = field(repr=False)
    plan: WindowPlan | None = None
    text_ids: np.ndarray | None = field(default=None, repr=False)  # [T] the tokens the windows cover
    files: tuple[Path, ...] = ()


def _check_options(o: FidelityOptions) -> None:
    if o.pkg is None:
        raise OrtEvalsError("pass --pkg PATH (the candidate GenAI package folder)")
    if not o.ref:
        raise OrtEvalsError("pass --ref PATH (a GenAI package, a transformers checkpoint folder or a reference file)")
    if o.text is not None and o.data is not None:
        raise OrtEvalsError("pass --text FILE or --data, not both")
    if o.ctx is not None and (o.ctx < 4 or o.ctx % 2):
        raise OrtEvalsError(f"--ctx must be an even number >= 4, got {o.ctx}")
    if o.tokens is not None and o.tokens < 1:
        raise OrtEvalsError(f"--tokens must be >= 1, got {o.tokens}")
    if o.top_k is not None and not 64 <= o.top_k <= 256:
        raise OrtEvalsError(f"--top-k must be between 64 and 256, got {o.top_k}")
    for flag, value in (("--buckets", o.buckets), ("--kl-threshold", o.kl_threshold), ("--plot", o.plot)):
        if value is not None and not o.by_position and o.trajectories is None:
            raise OrtEvalsError(f"{flag} needs --by-position (the breakdown by context length) or --trajectories")
    _check_trajectories(o)
    check_threshold(o.kl_threshold)
    outputs = ((o.json, "--json"), (o.save_ref, "--save-ref"), (o.plot, "--plot"))
    for path, flag in outputs:  # before the work, not after it
        if path is not None:
            check_writable_file(Path(path), flag)


def _check_trajectories(o: FidelityOptions) -> None:
    if o.first is not None and (o.trajectories is None or o.first < 1):
        raise OrtEvalsError(f"--first {o.first}: expected a number of generated tokens >= 1, with --trajectories")
    if o.trajectories is None:
        return
    given = [f for f, v in (("--text", o.text), ("--data", o.data), ("--ctx", o.ctx), ("--save-ref", o.save_ref),
                            ("--by-position", o.by_position or None)) if v is not None]
    if given:
        raise OrtEvalsError(f"--trajectories follows the reference run's outputs: {given[0]} does not apply")
    if reference_kind(o.ref) == "file":
        raise OrtEvalsError("--trajectories needs a model as --ref (a package or a checkpoint), not a reference file")
    tr.check_edges(o.buckets, o.first or tr.DEFAULT_FIRST)


def reference_kind(ref: str) -> str:
    """``file``, ``package`` or ``torch``; anything else is a one-line error."""
    path = Path(ref).expanduser()
    if path.is_file():
        return "file"
    if (path / "genai_config.json").is_file():
        return "package"
    if (path / "config.json").is_file():
        return "torch"
    raise OrtEvalsError(f"{path}: --ref must be a GenAI package folder (genai_config.json), a transformers "
                        "checkpoint folder (config.json) or a reference file from --save-ref")


def bos_for_windows(tok) -> int | None:
    """The BOS id when the package's tokenizer adds one by default (then every window starts with it)."""
    with_special, plain = tok.encode("a"), tok.encode("a", add_special_tokens=False)
    bos = tok.special.bos_id
    if bos is not None and len(with_special) > len(plain) and with_special[0] == bos:
        return bos
    return None


def text_ids(tok, o: FidelityOptions, needed: int | None) -> np.ndarray:
    """The text's token ids ``[T]`` (no special tokens): at least ``needed`` when the text has them."""
    if o.text is not None:
        try:
            text = Path(o.text).expanduser().read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise OrtEvalsError(f"{o.text}: cannot read the text as UTF-8 ({e})") from None
        return np.asarray(tok.encode(text, add_special_tokens=False), np.int64)
    from ortevals.fidelity.text import default_text

    chars = None if needed is None else 8 * needed + 20000
    while True:
        text = default_text(o.data, chars)
        ids = np.asarray(tok.encode(text, add_special_tokens=False), np.int64)
        if chars is None or len(ids) >= needed or len(text) < chars:
            return ids
        chars *= 2


def _mismatch(what: str, ref: str, ref_hash: str, cand: Path, cand_hash: str) -> OrtEvalsError:
    return OrtEvalsError(f"different tokenizers ({what}): reference {ref} has tokenizer {ref_hash[:12]}, "
                         f"candidate {cand} has {cand_hash[:12]}; fidelity needs the same tokens on both sides")


def _saved_side(o, package, tok, cand_hash):
    """Reference from a file: its plan and text ids, checked against the candidate's tokenizer and options."""
    saved = load_reference(Path(o.ref).expanduser())
    if saved.tokenizer_sha256 != cand_hash:
        raise _mismatch("tokenizer.json hash", str(saved.path), saved.tokenizer_sha256, o.pkg, cand_hash)
    if o.tokens is not None and o.tokens > saved.plan.n_scored:
        raise OrtEvalsError(f"{saved.path}: holds {saved.plan.n_scored} scored tokens; got --tokens {o.tokens}")
    if o.tokens is not None:  # a prefix of the saved windows: what a direct run with --tokens scores
        saved = saved.first(o.tokens)
    p = saved.plan
    if p.every != o.by_position:
        said = "with" if p.every else "without"
        raise OrtEvalsError(f"{saved.path}: saved {said} --by-position; pass {'' if p.every else 'no '}--by-position "
                            "(it scores every position of a window, not only the second half)")
    for name, given, stored in (("--ctx", o.ctx, p.n_ctx), ("--top-k", o.top_k, saved.tokens.topk_ids.shape[1])):
        if given is not None and given != stored:
            raise OrtEvalsError(f"{saved.path}: saved with {name} {stored}; got {name} {given}")
    if saved.vocab_size != package.vocab_size:
        raise OrtEvalsError(f"{saved.path}: reference vocabulary {saved.vocab_size}, candidate "
                            f"{package.vocab_size} ({o.pkg})")
    bos = bos_for_windows(tok)
    if p.bos_id != (-1 if bos is None else bos):
        raise _mismatch("BOS rule", str(saved.path), saved.tokenizer_sha256, o.pkg, cand_hash)
    used = p.n_windows * p.text_per_window
    if o.text is not None or o.data is not None:
        ids = text_ids(tok, o, used)[:used]
        if not np.array_equal(ids, saved.text_ids[:used]):
            raise _mismatch("token ids of the text", str(saved.path), saved.tokenizer_sha256, o.pkg, cand_hash)
    return saved, p, saved.text_ids, saved.windows(), saved.description


def _open_reference(o, package, cand_hash):
    """A model reference as a logit source, after its tokenizer and vocabulary are checked."""
    kind, path = reference_kind(o.ref), Path(o.ref).expanduser()
    if kind == "package":
        from ortevals.package.loader import ModelPackage

        ref_pkg = ModelPackage.load(path, o.ep)
        warn_base_model(ref_pkg, "fidelity")
    ref_hash = tokenizer_hash(ref_pkg.tokenizer_root if kind == "package" else path)
    if ref_hash != cand_hash:
        raise _mismatch("tokenizer.json hash", str(path), ref_hash, o.pkg, cand_hash)
    if kind == "package":
        source, vocab, max_pos = OrtSource.open(ref_pkg, o.ep), ref_pkg.vocab_size, ref_pkg.context_length
    else:
        from ortevals.fidelity.reference import TorchSource

        source = TorchSource.open(path)
        vocab, max_pos = source.vocab_size, source.max_positions
    if vocab != package.vocab_size:
        raise OrtEvalsError(f"{path}: reference vocabulary {vocab}, candidate {package.vocab_size} ({o.pkg})")
    return source, max_pos, f"{path} ({kind})"


def _model_side(o, package, tok, cand_hash):
    """Reference from a model: the plan, the text ids and a lazy stream of per-window reference statistics."""
    source, max_pos, desc = _open_reference(o, package, cand_hash)
    limits = [n for n in (package.context_length, max_pos) if n]
    ids, plan = text_windows(tok, o, limits, o.ctx, o.tokens or DEFAULT_TOKENS, o.by_position)
    return None, plan, ids, reference_windows(source, ids, plan, o.top_k or DEFAULT_TOP_K), desc


def text_windows(tok, o: FidelityOptions, limits: list[int], ctx: int | None,
                 tokens: int, every: bool = False) -> tuple[np.ndarray, WindowPlan]:
    """The text's token ids cut to whole windows, and the window plan: ``ctx`` tokens a window (default
    :data:`DEFAULT_CTX`, :data:`POSITION_CTX` with ``every``, at most the models' context ``limits``), about
    ``tokens`` scored (``every``: at every position of a window)."""
    n_ctx = ctx or min([POSITION_CTX if every else DEFAULT_CTX, *limits])
    if limits and n_ctx > min(limits):
        raise OrtEvalsError(f"--ctx {n_ctx} is longer than the models' context ({min(limits)} tokens)")
    bos = bos_for_windows(tok)
    probe = WindowPlan(n_ctx, -1 if bos is None else bos, 0, 0, every)
    ids = text_ids(tok, o, math.ceil(tokens / max(probe.scored_per_window, 1)) * probe.text_per_window)
    plan = plan_windows(len(ids), n_ctx, bos, tokens, every)
    return ids[:plan.n_windows * plan.text_per_window], plan


def run_fidelity(o: FidelityOptions) -> FidelityReport:
    """Compare the candidate package with the reference over the text; write --save-ref and --json."""
    from ortevals.package.loader import ModelPackage
    from ortevals.package.tokenizer import Tokenizer

    _check_options(o)
    package = ModelPackage.load(Path(o.pkg).expanduser(), o.ep)
    warn_base_model(package, "fidelity")  # a LoRA package: its base model is compared
    tok = Tokenizer.load(package)
    cand_hash = tokenizer_hash(package.tokenizer_root)
    if o.trajectories is not None:
        return _follow(o, package, tok, cand_hash)
    if o.by_position and o.buckets is not None and (o.ctx or reference_kind(o.ref) != "file"):
        bucket_edges(o.ctx or min(POSITION_CTX, package.context_length or POSITION_CTX), o.buckets)  # before work
    side = _saved_side if reference_kind(o.ref) == "file" else _model_side
    saved, plan, ids, refs, desc = side(o, package, tok, cand_hash)
    if saved is not None and o.save_ref is not None:
        raise OrtEvalsError("--save-ref needs a model as --ref, not a reference file")
    edges = bucket_edges(plan.n_ctx, o.buckets) if plan.every else None  # the window's: before any model runs
    kept: list[RefTokens] = []
    if o.save_ref is not None:
        refs = _tee(refs, kept)
    candidate = OrtSource.open(package, o.ep)
    stats = concat_stats(list(compare_windows(candidate, ids, plan, refs, _progress(plan))))
    clusters = plan.clusters()
    summary = {"candidate": str(o.pkg), "reference": desc, "n_ctx": plan.n_ctx,
               "top_k": int(saved.tokens.topk_ids.shape[1]) if saved else (o.top_k or DEFAULT_TOP_K),
               **summarize(stats, clusters)}
    summary["ppl"]["diff"], summary["ppl"]["diff_se"] = ppl_difference(summary["ppl"])  # llama.cpp's PPL(Q)-PPL(base)
    summary["scored"] = "every position" if plan.every else "second half of each window"
    files = []
    if plan.every:
        summary["by_position"] = position_summary(stats, clusters, plan.positions(), edges, o.kl_threshold)
    if o.save_ref is not None:
        tokens = RefTokens(*(np.concatenate([getattr(r, f) for r in kept]) for f in
                             ("topk_ids", "topk_logp", "tail_logp", "actual_logp")))
        size = save_reference(Path(o.save_ref), SavedReference(Path(o.save_ref), desc, cand_hash, plan,
                                                               package.vocab_size, ids, tokens))
        summary["reference_file"] = {"path": str(o.save_ref), "bytes": size, "bytes_per_token": size / plan.n_scored,
                                     "llama_cpp_bytes_per_token": 2 * package.vocab_size}
        files.append(Path(o.save_ref))
    files += _write_files(o, summary)
    return FidelityReport(summary, stats, clusters, plan, ids, tuple(files))


def _follow(o: FidelityOptions, package, tok, cand_hash: str) -> FidelityReport:
    """``--trajectories``: both models teacher-forced on the reference run's outputs (fidelity/trajectories.py)."""
    items = tr.outputs(Path(o.trajectories))  # a missing or unusable run: refused before a model opens
    source, max_pos, desc = _open_reference(o, package, cand_hash)
    first = o.first or tr.DEFAULT_FIRST
    context = _context(o, package, max_pos)
    seqs, cut = tr.sequences(items, tok, first, o.tokens, context)
    stats, clusters, index = tr.follow(source, OrtSource.open(package, o.ep), seqs, o.top_k or DEFAULT_TOP_K)
    summary = {"candidate": str(o.pkg), "reference": desc, "trajectories": str(o.trajectories),
               "top_k": o.top_k or DEFAULT_TOP_K, **tr.trajectory_summary(stats, clusters, index, first, o.buckets,
                                                                           o.kl_threshold),
               "cut": {"questions": cut, "context": context.length, "where": context.where} if context else None}
    return FidelityReport(summary, stats, clusters, files=_write_files(o, summary))


def _context(o: FidelityOptions, package, max_pos: int | None) -> tr.Context | None:
    """The smaller of the two models' contexts, and the file and field that say it."""
    ref = Path(o.ref).expanduser()
    ref_where = (f"model.context_length in {ref / 'genai_config.json'}" if reference_kind(o.ref) == "package"
                 else f"max_position_embeddings in {ref / 'config.json'}")
    sides = [(n, where) for n, where in ((package.context_length, f"model.context_length in "
                                          f"{package.root / 'genai_config.json'}"), (max_pos, ref_where)) if n]
    return tr.Context(*min(sides)) if sides else None


def _write_files(o: FidelityOptions, summary: dict) -> tuple[Path, ...]:
    """--json and --plot of a summary."""
    files = []
    if o.json is not None:
        from ortevals.files import atomic_write, json_text

        atomic_write(Path(o.json), json_text(summary, indent=2) + "\n")  # strict: no SE is null, not NaN
        files.append(Path(o.json))
    if o.plot is not None:
        from ortevals.fidelity.plot import plot_positions

        plot_positions(summary, Path(o.plot))
        files.append(Path(o.plot))
    return tuple(files)


def _tee(refs, kept: list):
    """Pass each window's reference statistics on (float64) and keep a copy in the file's dtypes."""
    for r in refs:
        kept.append(RefTokens(r.topk_ids.astype(np.int32), r.topk_logp.astype(np.float32),
                              r.tail_logp.astype(np.float32), r.actual_logp.astype(np.float32)))
        yield r


def _progress(plan: WindowPlan):
    """A bar over the windows on stderr (tqdm's, as the scoring bar: in a log too), closed after the last."""
    from tqdm import tqdm

    bar = tqdm(total=plan.n_windows, desc="fidelity", unit="window", dynamic_ncols=True)

    def step(w: int) -> None:
        bar.update(1)
        if w == plan.n_windows - 1:
            bar.close()

    return step


def ppl_difference(ppl: dict) -> tuple[float, float]:
    """llama.cpp's ``Mean PPL(Q)-PPL(base)`` and its standard error: the two perplexities' SEs combined
    with their correlation, ``sqrt(se_c² + se_r² − 2·cor·se_c·se_r)`` (llama.cpp's ``ppl_diff_unc``);
    NaN where one window gives no SE."""
    a, b, cor = ppl["ppl_cand_se"], ppl["ppl_ref_se"], ppl["cor_ln_ppl"]
    var = a * a + b * b - 2.0 * cor * a * b
    return ppl["ppl_cand"] - ppl["ppl_ref"], math.sqrt(var) if var > 0 else (0.0 if var == 0 else math.nan)


def _pm(value: float, se: float, width: int = 10, digits: int = 6) -> str:
    """``value ± se``, with ``± n/a`` where there is no standard error (one window)."""
    err = f"{se:{width}.{digits}f}" if math.isfinite(se) else f"{'n/a':>{width}}"
    return f"{value:{width}.{digits}f} ± {err}"


def format_report(s: dict) -> str:
    """The printed report: llama.cpp's ``--kl-divergence`` layout; every ± is a window-clustered SE."""
    if "trajectories" in s:
        return "\n".join(tr.format_lines(s))
    kl, dp, ppl = s["kl"], s["delta_p"], s["ppl"]
    lo, hi = ppl["ratio_ci95"]
    diff, diff_se = ppl_difference(ppl)
    one = s["windows"] < 2
    cor = f"{100 * ppl['cor_ln_ppl']:6.2f}%" if math.isfinite(ppl["cor_ln_ppl"]) else "   n/a"
    interval = f"95% CI {lo:.6f} … {hi:.6f}, paired" if math.isfinite(lo) and math.isfinite(hi) else "no interval"
    lines = [
        f"candidate: {s['candidate']}", f"reference: {s['reference']}",
        f"{s['tokens']} tokens scored in {s['windows']} windows of {s['n_ctx']} "
        f"({s.get('scored', 'second half of each window')}); "
        f"top-k {s['top_k']}; ± is a standard error clustered by window",
        *([f"one window gives no standard error or interval (n/a below): errors are clustered by window, so at "
           f"least two are needed; raise --tokens above {s['tokens']} (or lower --ctx)"] if one else []),
        "", "====== Perplexity statistics ======",
        f"Mean PPL(cand)                : {_pm(ppl['ppl_cand'], ppl['ppl_cand_se'])}",
        f"Mean PPL(ref)                 : {_pm(ppl['ppl_ref'], ppl['ppl_ref_se'])}",
        f"Cor(ln(PPL(cand)), ln(PPL(ref))): {cor}",
        f"Mean ln(PPL(cand)/PPL(ref))   : {_pm(ppl['log_ratio'], ppl['log_ratio_se'])}",
        f"Mean PPL(cand)/PPL(ref)       : {_pm(ppl['ratio'], ppl['ratio_se'])}  ({interval})",
        f"Mean PPL(cand)-PPL(ref)       : {_pm(diff, diff_se)}",
        "", "====== KL divergence statistics (nats; top-k + tail: a lower bound of the full KL) ======",
        f"Mean    KLD: {kl['mean']:12.6g} ± " + (f"{kl['se']:10.4g}" if math.isfinite(kl["se"]) else f"{'n/a':>10}"),
        *(f"{label:<7} KLD: {kl[key]:12.6g}" for label, key in
          (("Maximum", "max"), ("99.9%", "p99.9"), ("99.0%", "p99"), ("90.0%", "p90"), ("Median", "p50"),
           ("10.0%", "p10"), ("5.0%", "p5"), ("1.0%", "p1"), ("Minimum", "min"))),
        "", "====== Token probability statistics ======",
        f"Mean    Δp: {_percent(dp['mean'], dp['se'])}",
        *(f"{label:<7} Δp: {100 * dp[key]:9.4f}%" for label, key in
          (("Maximum", "max"), ("99.9%", "p99.9"), ("99.0%", "p99"), ("95.0%", "p95"), ("90.0%", "p90"),
           ("75.0%", "p75"), ("Median", "p50"), ("25.0%", "p25"), ("10.0%", "p10"), ("5.0%", "p5"),
           ("1.0%", "p1"), ("0.1%", "p0.1"), ("Minimum", "min"))),
        f"RMS Δp    : {_percent(dp['rms'], dp['rms_se'])}",
        f"Same top p: {_percent(s['same_top1']['mean'], s['same_top1']['se'])}",
        f"Top-k overlap: {_percent(s['topk_overlap']['mean'], s['topk_overlap']['se'])}",
    ]
    if "by_position" in s:
        lines += format_lines(s)
    if "reference_file" in s:
        f = s["reference_file"]
        lines += ["", f"reference file: {f['path']}, {f['bytes']} bytes, {f['bytes_per_token']:.0f} bytes per token "
                      f"(llama.cpp: {f['llama_cpp_bytes_per_token']})"]
    return "\n".join(lines)


def _percent(value: float, se: float) -> str:
    return f"{100 * value:9.4f} ± " + (f"{100 * se:.4f} %" if math.isfinite(se) else "n/a %")
