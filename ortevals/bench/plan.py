"""Before any run: every input of a benchmark checked, and the rows it will run.

Owns :func:`plan`: :class:`~ortevals.bench.spec.BenchOptions` to a :class:`Plan` (the rows in table order,
the reference row, the rate's unit), raising one :class:`~ortevals.errors.OrtEvalsError` line for each bad
input before any process starts (docs/bad-inputs.md): an unknown backend or cache state, a candidate that is
no package or transformers folder, model args ortevals refuses (a row's LoRA adapter checked against its
package), a reference not among the rows, rows of different tokenizers compared per generated token, a backend
whose extra is not installed, an ``--ep`` this onnxruntime cannot give the rows that run it. A backend outside
ortevals' extras (vllm) that is not installed is a row that says so instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import util
from pathlib import Path

from ortevals.bench.spec import (
    BACKENDS,
    CACHE_STATES,
    CHECKPOINT_BACKENDS,
    DEFAULT_PEER_LIMIT,
    ONNX_PEERS,
    RATES,
    BenchOptions,
    Candidate,
    RowSpec,
    default_rate,
    parse_candidate,
)
from ortevals.decision import check_decide, plan_decision
from ortevals.errors import DataError, OrtEvalsError, PackageError, ProviderError, RuntimeMissingError, did_you_mean
from ortevals.fidelity.reference import tokenizer_hash
from ortevals.files import check_writable_folder
from ortevals.options import parse_arg_string, parse_model_args
from ortevals.package.loader import ModelPackage
from ortevals.package.multimodal import has_media_models
from ortevals.package.session_options import normalize
from ortevals.presets import PRESETS, resolve_data, resolve_local, task_specs
from ortevals.runtime.adapters import run_adapter
from ortevals.runtime.opening import check_available
from ortevals.runtime.providers import from_package
from ortevals.tasks import check_task_names, generates, task_manager

OUTPUT_FILES = ("bench.json", "bench.md", "bench.png", "runs")
EXTRAS = {  # backend -> (modules it imports, the extra that installs them)
    "ortevals": (("onnxruntime", "onnxruntime_genai"), "cpu"),
    "onnxruntime-genai": (("onnxruntime_genai",), "cpu"),
    "onnxruntime": (("onnxruntime",), "cpu"),
    "hf": (("torch", "transformers"), "torch"),
}
RESERVED_ARGS = ("store", "resume", "samples")  # set by the bench itself (--cache, --samples)


@dataclass(frozen=True)
class Plan:
    rows: tuple[RowSpec, ...]
    ref: str  # the reference row's label
    rate: str  # "requests" or "tokens"


def plan(options: BenchOptions) -> Plan:
    """The rows of ``options`` and their reference, every input checked (one line each, nothing run)."""
    _check_numbers(options)
    backends = _backends(options)
    pkgs = [_package(parse_candidate(p)) for p in options.pkgs]
    hf = _checkpoint(parse_candidate(options.hf)) if options.hf else None
    _check_targets(backends, pkgs, hf, options)
    _check_extras(backends)
    _check_provider(options.ep, backends)
    _check_data(options)
    _check_decide(options, backends)
    if options.output is not None:
        check_writable_folder(options.output, "--output", OUTPUT_FILES)
    rows = _label(_rows(backends, pkgs, hf, options))
    ref = _reference(rows, options.ref)
    rate = default_rate(options)
    if rate == "tokens":
        _check_generates(options)
        _check_tokenizers(rows)
    return Plan(tuple(rows), ref, rate)


def _check_numbers(o: BenchOptions) -> None:
    for flag, value in (("--limit", o.limit), ("--peer-limit", o.peer_limit), ("--samples", o.samples),
                        ("--max-gen-toks", o.max_gen_toks), ("--repeat", o.repeat)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise OrtEvalsError(f"{flag} {value}: expected a whole number >= 1")
    if o.timeout is not None and not o.timeout > 0:
        raise OrtEvalsError(f"--timeout {o.timeout}: expected seconds > 0")
    if o.peak_tflops is not None and not o.peak_tflops > 0:
        raise OrtEvalsError(f"--peak-tflops {o.peak_tflops:g}: expected the device's peak TFLOP/s > 0 "
                            "(dense fp16: 989 on an H100 or H200)")
    for state in o.cache:
        if state not in CACHE_STATES:
            raise OrtEvalsError(f"--cache {state}: unknown cache state; expected some of {', '.join(CACHE_STATES)}"
                                f"{did_you_mean(state, CACHE_STATES)}")
    if not o.cache:
        raise OrtEvalsError(f"--cache: expected some of {', '.join(CACHE_STATES)}")
    if o.rate is not None and o.rate not in RATES:
        raise OrtEvalsError(f"--rate {o.rate}: expected requests or tokens")
    if not o.tasks and o.max_gen_toks is not None and not o.cot:
        raise OrtEvalsError(f"--max-gen-toks {o.max_gen_toks} applies to generation; MMLU-Pro without --cot scores "
                            "log-likelihoods (add --cot, or drop --max-gen-toks)")
    if not o.tasks and o.samples is not None and not o.cot:
        raise OrtEvalsError(f"--samples {o.samples} needs generation; MMLU-Pro without --cot scores "
                            "log-likelihoods (add --cot)")
    if o.tasks and o.cot:
        raise OrtEvalsError("--cot chooses MMLU-Pro's chain-of-thought tasks; give --tasks or --cot, not both")
    if not o.tasks and o.rate == "tokens" and not o.cot:
        raise OrtEvalsError("--rate tokens counts generated tokens; MMLU-Pro without --cot scores log-likelihoods "
                            "and generates none (add --cot, or drop --rate tokens)")


def _backends(o: BenchOptions) -> tuple[str, ...]:
    given = o.backends or (("ortevals", "hf") if o.hf else ("ortevals",))
    for name in given:
        if name not in BACKENDS:
            raise OrtEvalsError(f"--backends {name}: unknown backend{did_you_mean(name, BACKENDS)}; expected some "
                                f"of {', '.join(BACKENDS)}")
    if len(set(given)) != len(given):
        raise OrtEvalsError(f"--backends {','.join(given)}: a backend named twice (to run one twice, give its "
                            "--pkg twice or --repeat)")
    return tuple(given)


def _package(c: Candidate) -> Candidate:
    path = Path(c.path).expanduser()
    if not (path / "genai_config.json").is_file():
        what = "not found" if not path.exists() else "has no genai_config.json"
        raise PackageError(f"--pkg {c.path}: {what}; expected a GenAI package folder ([LABEL=]PATH[:K=V,…])")
    args = parse_arg_string(c.args)
    reserved = [k for k in args if k in RESERVED_ARGS]
    if reserved:
        raise OrtEvalsError(f"--pkg {c.path}:{c.args}: {reserved[0]} is set by the bench (--cache states, --samples); "
                            "drop it from the row's model args")
    model = parse_model_args({"pkg": str(path), **args})  # ortevals' own checks of the row's options, before any run
    if model.adapter:  # a LoRA adapter's file against the package's adapter inputs (runtime/adapters.py)
        try:
            package = ModelPackage.load(path, model.ep)
            run_adapter(package, model.adapter, has_media_models(package))
        except OrtEvalsError as e:
            raise OrtEvalsError(f"--pkg {c.path}:{c.args}: {e}") from None
    return Candidate(str(path), c.args, c.label)


def _checkpoint(c: Candidate) -> Candidate:
    path = Path(c.path).expanduser()
    if not (path / "config.json").is_file():
        what = "not found" if not path.exists() else "has no config.json"
        raise OrtEvalsError(f"--hf {c.path}: {what}; expected a transformers model folder ([LABEL=]PATH[:K=V,…])")
    parse_arg_string(c.args)
    return Candidate(str(path), c.args, c.label)


def _check_targets(backends, pkgs, hf, o: BenchOptions) -> None:
    needs_pkg = [b for b in backends if b == "ortevals" or b in ONNX_PEERS]
    if needs_pkg and not pkgs:
        raise OrtEvalsError(f"--backends {needs_pkg[0]} runs a GenAI package: give --pkg PATH")
    wants_hf = [b for b in backends if b in CHECKPOINT_BACKENDS]
    if wants_hf and hf is None:
        raise OrtEvalsError(f"--backends {wants_hf[0]} runs a transformers folder: give --hf PATH")
    if hf is not None and not wants_hf:
        raise OrtEvalsError(f"--hf {o.hf}: no backend runs it; add hf (or vllm) to --backends")
    if pkgs and not needs_pkg:
        raise OrtEvalsError(f"--pkg {o.pkgs[0]}: no backend runs it; add ortevals (or onnxruntime-genai, "
                            "onnxruntime) to --backends")


def _check_extras(backends) -> None:
    for name in backends:
        if name not in EXTRAS:
            continue
        modules, extra = EXTRAS[name]
        missing = [m for m in modules if util.find_spec(m) is None]
        if missing:
            raise RuntimeMissingError(f"--backends {name} needs {missing[0]}, which is not installed: "
                                      f"pip install 'ortevals[{extra}]'")


def _check_provider(ep: str | None, backends) -> None:
    """``--ep`` names a provider (any spelling ortevals takes), one this onnxruntime offers (or an installed
    plugin's) where a row runs onnxruntime, and cpu or cuda with a CUDA device torch sees where lm-eval's hf runs:
    else every such row would fail the same way after the others had run (ortevals' own line: what to install)."""
    if ep is None:
        return
    try:
        name = normalize(ep)
    except ProviderError as e:
        raise ProviderError(f"--ep {ep}: {e}") from None
    if name != "cpu" and any(b in ("ortevals", *ONNX_PEERS) for b in backends):
        try:
            check_available(from_package({}, ep, where="--ep"))
        except ProviderError as e:
            raise ProviderError(str(e) if str(e).startswith("--ep") else f"--ep {ep}: {e}") from None
    if "hf" in backends:
        if name not in ("cpu", "cuda"):
            raise ProviderError(f"--ep {ep}: lm-eval's hf row runs on the CPU or CUDA (cuda:0); expected cpu or "
                                "cuda, or drop hf from --backends")
        if name == "cuda":
            _check_torch_cuda(ep)


def _check_torch_cuda(ep: str) -> None:
    import torch  # an optional heavy dependency (the torch extra, checked above), loaded only for hf on CUDA

    if not torch.cuda.is_available():
        raise ProviderError(f"--ep {ep}: torch {torch.__version__} sees no CUDA device, so lm-eval's hf row would "
                            "fail on cuda:0; install a CUDA build of torch, or drop hf from --backends")


def _check_data(o: BenchOptions) -> None:
    """``--data`` is what the rows' command reads (the MMLU-Pro copy checked as ``ortevals mmlu-pro`` checks it;
    a folder for ``--tasks``): else every row would fail the same way."""
    if o.data is None:
        return
    try:
        if o.tasks:
            resolve_local(o.data)
        else:
            resolve_data(PRESETS["mmlu-pro-cot" if o.cot else "mmlu-pro"], o.data)
    except DataError as e:
        said = str(e).removeprefix(f"{Path(o.data).expanduser()}: ")
        if said.startswith("--data"):
            raise
        hint = "" if o.tasks else "; or --data bundled, the copy inside ortevals"
        raise DataError(f"--data {o.data}: {said}{hint}") from None


def _check_decide(o: BenchOptions, backends) -> None:
    """``--against RUN --decide M``: the flags as ``ortevals mmlu-pro`` checks them, every row an ortevals one
    (lm-eval's backends score every question, they cannot stop when decided), and the run read and matched to this
    data's questions (decision.py's plan) before any row: else every row would fail the same way."""
    if o.against is None and o.decide is None and o.decide_order is None:
        return
    if o.tasks:
        raise OrtEvalsError(f"--decide decides MMLU-Pro runs (ortevals mmlu-pro --against); --tasks "
                            f"{','.join(o.tasks)}: drop --tasks or --decide")
    peers = [b for b in backends if b != "ortevals"]
    if peers:
        raise OrtEvalsError(f"--decide stops ortevals rows when decided; lm-eval's {peers[0]} scores every question "
                            f"and cannot: drop {peers[0]} from --backends (its whole run: a separate bench)")
    spec = check_decide(None if o.against is None else Path(o.against).expanduser(), o.decide, None, None, None,
                        None, None, o.limit, o.decide_order)
    preset = PRESETS["mmlu-pro-cot" if o.cot else "mmlu-pro"]
    plan_decision(spec, task_specs(preset, resolve_data(preset, o.data or "bundled"), None), preset.task_manager())


def _check_generates(o: BenchOptions) -> None:
    """``--rate tokens`` with ``--tasks``: at least one task generates (else there is no token to count)."""
    if not o.tasks:
        return  # MMLU-Pro: --cot checked with the numbers
    tm = task_manager(None)
    check_task_names(list(o.tasks), "--tasks")
    if not generates(list(o.tasks), tm):
        raise OrtEvalsError(f"--rate tokens counts generated tokens; --tasks {','.join(o.tasks)} score "
                            "log-likelihoods and generate none (use --rate requests, or a generation task)")


def _rows(backends, pkgs: list[Candidate], hf: Candidate | None, o: BenchOptions) -> list[RowSpec]:
    peer_limit = min(o.peer_limit or DEFAULT_PEER_LIMIT, o.limit) if o.limit else o.peer_limit or DEFAULT_PEER_LIMIT
    rows: list[RowSpec] = []
    for backend in backends:
        if backend == "ortevals":
            for p in pkgs:
                for state in o.cache:
                    name = p.label or _name("ortevals", p.path, p.args)
                    suffix = f" ({state})" if len(o.cache) > 1 or state != "warm" else ""
                    rows.append(RowSpec(name + suffix, backend, p.path, p.args, state, o.limit))
        elif backend in ONNX_PEERS:
            for path in dict.fromkeys(p.path for p in pkgs):  # each package once: the options are ortevals'
                rows.append(RowSpec(_name(backend, path), backend, path, "", None, peer_limit))
        else:
            missing = None if backend in EXTRAS or util.find_spec(backend) else f"not installed (pip install {backend})"
            rows.append(RowSpec(hf.label if hf.label and backend == "hf" else _name(backend, hf.path, hf.args),
                                backend, hf.path, hf.args, None, o.limit, missing))
    return rows


def _name(backend: str, path: str, args: str = "") -> str:
    return f"{backend} {Path(path).name}" + (f" [{args}]" if args else "")


def _label(rows: list[RowSpec]) -> list[RowSpec]:
    """Labels made unique: the second row of a label gets ``#2`` (the same package given twice)."""
    seen: dict[str, int] = {}
    out = []
    for r in rows:
        seen[r.label] = seen.get(r.label, 0) + 1
        label = r.label if seen[r.label] == 1 else f"{r.label} #{seen[r.label]}"
        out.append(RowSpec(label, r.backend, r.target, r.args, r.cache, r.limit, r.missing))
    return out


def _reference(rows: list[RowSpec], ref: str | None) -> str:
    runnable = [r for r in rows if r.missing is None]
    if ref is None:
        return next((r.label for r in runnable if r.backend == "hf"), runnable[0].label if runnable else rows[0].label)
    by_label = [r for r in rows if r.label == ref]
    by_backend = [r for r in rows if r.backend == ref]
    found = by_label or (by_backend if len(by_backend) == 1 else [])
    if not found:
        many = f" ({len(by_backend)} rows run {ref}: give one's label)" if len(by_backend) > 1 else ""
        raise OrtEvalsError(f"--ref {ref}: not among the rows{many}; expected one of: "
                            + "; ".join(r.label for r in rows))
    if found[0].missing:
        raise OrtEvalsError(f"--ref {ref}: that row is not run ({found[0].missing})")
    return found[0].label


def _check_tokenizers(rows: list[RowSpec]) -> None:
    """Generated tokens/s is counted with one tokenizer: every row's target must hold the same one."""
    first: tuple[str, str] | None = None
    for r in rows:
        if r.missing:
            continue
        digest = tokenizer_hash(Path(r.target))
        if first is None:
            first = (r.label, digest)
        elif digest != first[1]:
            raise OrtEvalsError(f"rows {first[0]!r} and {r.label!r} have different tokenizers (tokenizer.json): "
                                "generated tokens/s would count different units; compare them per request "
                                "(--rate requests) or bench packages of one tokenizer")
