"""The one options table: every model argument, for every front door.

Owns the list of ortevals' model arguments (:data:`OPTIONS`): name, parser,
default, help text, the ``ortevals`` CLI flag that sets it (if it has its own),
and whether it can change a number (``scoped``: then it is part of the result
store's scope). The lm-eval model args (``pkg=…,ep=cpu``), the CLI
(``--ep``, ``--model-args K=V,…``) and the Olive evaluator's arguments are all
parsed here by :meth:`ModelArgs.parse`, so they accept the same names and give
the same one-line errors, including the settings that would do nothing or harm
in the company of others (:data:`NEEDS`, :func:`check_settings`).

Pure: no I/O, no runtime imports (the CPU count is read from the interpreter).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ortevals.engine.score.scoring import TRUNCATE_MODES
from ortevals.errors import OrtEvalsError, did_you_mean
from ortevals.package.adapters import parse_adapters

PKG_ALIASES = ("pretrained", "model")  # lm-eval spellings of the package folder
IGNORED = ("device", "max_batch_size")  # lm-eval passes its torch device and batch cap; the EP is `ep`


MAX_ROWS = 65536  # rows of one forward pass (batch_size, gen_batch_size): beyond it no pass fits any device
MAX_SAMPLES = 10000  # samples per question: the largest K of published repeated-sampling studies


def positive_int(name: str, allow_zero: bool = False, most: int | None = None,
                 why: str = "") -> Callable[[Any], int]:
    def parse(value: Any) -> int:
        try:
            n = int(value)
        except (TypeError, ValueError):
            raise OrtEvalsError(f"{name} must be an integer, got {value!r}") from None
        if isinstance(value, float) and value != n or isinstance(value, bool):
            raise OrtEvalsError(f"{name} must be an integer, got {value!r}")
        if n < 0 or (n == 0 and not allow_zero):
            raise OrtEvalsError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {n}")
        if most is not None and n > most:
            raise OrtEvalsError(f"{name} must be at most {most}{why}, got {n}")
        return n

    return parse


def boolean(name: str) -> Callable[[Any], bool]:
    def parse(value: Any) -> bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise OrtEvalsError(f"{name} must be true or false, got {value!r}")

    return parse


def choice(name: str, values: tuple[str, ...]) -> Callable[[Any], str]:
    def parse(value: Any) -> str:
        text = str(value).strip().lower()
        if text not in values:
            raise OrtEvalsError(f"{name} must be one of {', '.join(values)}, got {value!r}")
        return text

    return parse


def text(name: str) -> Callable[[Any], str]:
    def parse(value: Any) -> str:
        if not isinstance(value, str) or not value.strip():
            raise OrtEvalsError(f"{name} must be a non-empty string, got {value!r}")
        return value.strip()

    return parse


def parse_batch_size(value: Any) -> int | None:
    """``auto`` (or None) -> None, else a positive int; ``auto:4`` style is accepted as auto."""
    if value is None or (isinstance(value, str) and value.lower().startswith("auto")):
        return None
    return positive_int("batch_size", most=MAX_ROWS, why=" rows per forward pass")(value)


def parse_passes(value: Any) -> int:
    """``auto`` -> 0 (resolved when the run opens: one per core on CPU unless ``threads`` is set), else > 0."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return 0
    return positive_int("passes")(value)


def verifier_spec(value: Any) -> str:
    """``self`` or a folder path (checked when the run opens it: integrations/verify.py's ``open_verifier``)."""
    if not isinstance(value, str) or not value.strip():
        raise OrtEvalsError("verifier must be self, a GenAI package folder, or an ONNX sequence classifier folder, "
                            f"got {value!r}")
    return "self" if value.strip().lower() == "self" else value.strip()


def separator(value: Any) -> str:
    """A step separator; backslash escapes (``\\n\\n``) are read as Python reads them, so a CLI can give one."""
    import codecs

    text = value if isinstance(value, str) else None
    try:
        text = codecs.decode(text, "unicode_escape") if text is not None and "\\" in text else text
    except UnicodeDecodeError:
        text = None
    if not text:
        raise OrtEvalsError(f"step_separator must be a non-empty string (escapes like \\n allowed), got {value!r}")
    return text


def parse_provider_options(value: Any) -> tuple[str, ...]:
    """``"k=v;k=v"``, a list of ``"k=v"`` or a mapping -> ``("k=v", …)``."""
    if isinstance(value, Mapping):
        items = [f"{k}={v}" for k, v in value.items()]
    elif isinstance(value, str):
        items = [p for p in value.split(";") if p.strip()]
    elif isinstance(value, (list, tuple)):
        items = [str(p) for p in value]
    else:
        raise OrtEvalsError(f"provider_options must be 'key=value;key=value', got {value!r}")
    for pair in items:
        key, sep, _ = pair.partition("=")
        if not sep or not key.strip():
            raise OrtEvalsError(f"provider option {pair!r} must look like key=value")
    return tuple(p.strip() for p in items)


@dataclass(frozen=True)
class Option:
    """One model argument: how it is parsed, its default, and who may set it."""

    name: str
    parse: Callable[[Any], Any]
    default: Any
    help: str
    scoped: bool = True  # can change a number: part of the result store's scope
    flag: str | None = None  # its own `ortevals mmlu-pro/run` flag, if any (else --model-args)
    metavar: str | None = None


OPTIONS: tuple[Option, ...] = (
    Option("pkg", text("pkg"), None, "GenAI package folder (holds genai_config.json).", scoped=False),
    Option("ep", text("ep"), None, "Execution provider: cpu, cuda, dml, … (default: the package's).", flag="--ep",
           metavar="NAME"),
    # scoped through what it resolves to: the options the sessions really get (lm.py), so an option that
    # is dropped for raw sessions neither splits nor mixes stored scores
    Option("provider_options", parse_provider_options, (), "Provider options, key=value (override the package's).",
           scoped=False, flag="--provider-option"),
    # runtime/placement.py: on a device provider a node onnxruntime would run on the CPU is an error unless
    # allowed; scoped (the sessions' config differs, and the CPU kernels compute other numbers)
    # issue 57 (runtime/adapters.py): scoped through what it reads, the adapter file by content (engine/backends.py
    # reads), not through its path or name
    Option("adapter", parse_adapters, (), "A LoRA adapter (an .onnx_adapter file, as Olive's generate-adapter writes "
           "it) active on every scoring and generation path of a package whose decoder has adapter inputs; NAME "
           "defaults to the file's stem. Given more than once (mmlu-pro, run): one result per adapter over one loaded "
           "base, in --output DIR/NAME.", scoped=False, flag="--adapter", metavar="FILE[=NAME]"),
    Option("allow_cpu_fallback", boolean("allow_cpu_fallback"), False, "On a GPU/NPU provider, let onnxruntime "
           "run the nodes that provider has no kernel for on the CPU (default: refused, naming their op types)."),
    Option("threads", positive_int("threads", allow_zero=True), None, "Intra-op threads (0: default).",
           flag="--threads", metavar="N"),
    Option("batch_size", parse_batch_size, None, "Rows per forward pass, or auto (default).", flag="--batch-size",
           metavar="N|auto"),
    # which thread computes a pass changes none of its numbers (tests/test_parallel.py); the sessions' thread
    # count it sets is in the scope through their settings
    Option("passes", parse_passes, 1, "Log-likelihood passes run at once on CPU, each on one onnxruntime thread: N, "
           "or auto (one per core unless threads is set); generation on the raw path then "
           "decodes on one thread.", scoped=False, flag="--passes", metavar="N|auto"),
    Option("max_length", positive_int("max_length"), None, "Context length (default: the package's context_length).",
           flag="--max-length", metavar="N"),
    Option("add_bos_token", boolean("add_bos_token"), None, "Force BOS on or off (default: hf's rules)."),
    Option("memory_budget_mb", positive_int("memory_budget_mb"), 2048, "Logits memory per batch under auto."),
    Option("prefix_cache", boolean("prefix_cache"), True, "Reuse the KV of shared prompt prefixes."),
    # issue 46 (runtime/prefix_graph.py): scoped, its attention sums over the prefix and the own tokens apart
    # (~1e-6 per logit); auto is resolved when the run opens (run/run.py engine_settings)
    Option("shared_prefix_batch", choice("shared_prefix_batch", ("auto", "on", "off")), "auto",
           "Inputs that share a cached prefix (a few-shot header): on (many in one pass, each row reading the "
           "one copy of the prefix's KV through a second, derived session of the decoder; a package it cannot "
           "serve falls back in one logged line), off (one input a pass on the prefix: no second session), auto "
           "(on with a GPU unless that second copy of the weights would take more than half of the memory it "
           "holds beside the first; off on CPU, where on is 10% faster but holds the weights twice and makes "
           "resumed runs equal within float32 rounding, not bit for bit). Needs prefix_cache, scoring_graph and the "
           "prefill path (path=auto or prefill)."),
    Option("prefix_budget_mb", positive_int("prefix_budget_mb"), 1024, "KV held for shared prefixes at once."),
    Option("scoring_graph", boolean("scoring_graph"), True, "Derived decoder: LM head only at scored positions."),
    Option("path", choice("path", ("auto", "prefill", "incremental")), "auto",
           "Log-likelihood path: auto | prefill | incremental."),
    Option("store", text("store"), None, "SQLite result store: finished requests are reused on a rerun.",
           scoped=False),
    Option("resume", boolean("resume"), True, "Reuse answers from the result store (false, the CLI's "
           "--no-resume: every request scored again; canary verdicts there are still reused).", scoped=False),
    Option("exact", boolean("exact"), False, "One row per pass, no prefix reuse: each input scored as if run "
           "alone (chosen by itself when the graph's numbers depend on the batch).", flag="--exact"),
    Option("check", boolean("check"), True, "Before a batched run, check on a few requests that batching and "
           "prefix reuse match one row per pass (--no-check skips it).", flag="--check"),
    Option("truncate", choice("truncate", TRUNCATE_MODES), "error",
           "A request longer than the context: error (default), or left (lm-eval hf's left truncation, counted).",
           flag="--truncate", metavar="error|left"),
    Option("max_gen_toks", positive_int("max_gen_toks"), 256, "Default cap on generated tokens."),
    Option("gen_batch_size", positive_int("gen_batch_size", most=MAX_ROWS, why=" rows decoded together"), 1,
           "Greedy requests per batched Generator (1: one cursor that rewinds)."),
    Option("seed", positive_int("seed", allow_zero=True), 1234, "Sampling seed."),
    # issue 13: requests with images/audio (ortevals/engine/media/og.py, fast.py)
    Option("media_path", choice("media_path", ("auto", "og", "fast")), "auto",
           "Image/audio requests: og (onnxruntime-genai's pipeline), fast (its processor, then raw onnxruntime "
           "with shared text-prefix KV), or auto (fast where the layout allows)."),
    # issue 15, data parallel on Ray (integrations/ray.py): where requests run, never what they give
    Option("workers", positive_int("workers"), None, "Data-parallel workers on Ray (a local cluster unless "
           "--ray-address); needs the ray extra.", scoped=False, flag="--workers", metavar="N"),
    Option("ray_address", text("ray_address"), None, "Run the workers on this Ray cluster (ray start --head "
           "prints it); default: all its GPUs, or one worker per node on CPU.", scoped=False, flag="--ray-address",
           metavar="ADDR"),
    # issue 14 (engine/generate/rows/sampler.py): which engine generates; raw = shared-prompt sampling on onnxruntime
    Option("gen_path", choice("gen_path", ("auto", "raw", "og")), "auto",
           "generate_until path: auto (raw where the package has full logits and a plain KV cache), raw "
           "(shared-prompt sampling on onnxruntime), og (onnxruntime-genai Generators)."),
    # issue 26 (engine/generate/rows/cascade_kv.py, runtime/cascade.py): scoped, its attention sums in another
    # order (~1e-6); auto is resolved when the run opens, from what the device holds (run/generate.py decode_plan)
    Option("cascade", choice("cascade", ("auto", "on", "off")), "auto",
           "Raw-path sampling of K rows of one prompt: auto (the rows attend to one shared copy of the prompt's "
           "KV where the decoder's attention can be rewritten exactly, checked once against the plain pass; "
           "costs a second session of the decoder, declined where that copy would take more than half of the "
           "memory the device holds beside the first), on (the same, an error where it cannot), off (each row "
           "keeps its own copy of the prompt KV)."),
    # scoped: which rows decode together can change a row's numbers (the cascade graph's), so it is sized by
    # what the device holds, never by what happens to be free
    Option("decode_budget_mb", positive_int("decode_budget_mb"), None,
           "Raw-path sampling: KV memory of one decode batch (the rows decoded together). Default: 80% of the "
           "memory the device holds where the KV lives (its total, not what is free, so every run on this "
           "machine decodes the same batches and draws the same samples)."),
    # not scoped: the store keys each sample by request + sample index, so raising K reuses the first K
    Option("samples", positive_int("samples", most=MAX_SAMPLES, why=" per question (each sample is a generation of "
                                   "up to max_gen_toks tokens; lm-eval holds K requests per question)"), None,
           "Samples per question: overrides the tasks' repeats and "
           "reports maj@k, pass@k and best-of-k for k = 1, 2, 4, … K (always sampling: at the gen_kwargs "
           "temperature where the run gives one, else the task's if it samples, else 0.7).", scoped=False,
           flag="--samples", metavar="K"),
    # issue 24 (report/calibration*.py): extra requests keyed by their own text; other answers unchanged
    Option("self_eval", boolean("self_eval"), False, "P(True): after each chosen choice (or generated answer) ask "
           "the package whether the proposed answer is true, and report its AUROC and calibration (multiple "
           "choice: the prompt's KV is reused, each choice costs its ~20 new tokens).", scoped=False,
           flag="--self-eval"),
    # issue 25 (integrations/verify.py, report/selection.py): scores after the run, never a generated token
    Option("verifier", verifier_spec, None, "With --samples K: score each question's K answers by self, a GenAI "
           "package folder, or an ONNX sequence classifier folder: self and a package folder by P(True) on that "
           "package (a question's prompt KV shared by its K answers), a classifier (model.onnx + tokenizer.json) "
           "by its one score; report bon@k and weighted_maj@k.", scoped=False,
           flag="--verifier", metavar="self|PATH"),
    Option("prm", boolean("prm"), False, "With --verifier: also score each step (split at step_separator) as the "
           "answer up to it, and report the PRM variants (bon_prm_last/min/prod, weighted_maj_prm_*).", scoped=False),
    Option("step_separator", separator, "\n\n", "Where a solution's steps end (PRM scores, step-level search).",
           scoped=False),
    Option("prm_aggregation", choice("prm_aggregation", ("last", "min", "prod")), "last",
           "How a solution's step scores become one in step-level search: last, min or prod.", scoped=False),
    # issue 25 (engine/generate/search/guided.py on search/rawrows.py): not scoped here; with --search the run's
    # scope is
    # narrowed by the search's settings and what its verifier reads (run/search.py search_scope)
    Option("search", choice("search", ("none", "beam", "dvts", "particles")), "none",
           "generate_until by step-level search guided by --verifier's step scores (steps at step_separator, "
           "folded by prm_aggregation): beam (PRM beam search), dvts, particles (particle filtering); raw path.",
           scoped=False, flag="--search", metavar="none|beam|dvts|particles"),
    Option("search_n", positive_int("search_n"), 4, "--search: beams, DVTS candidates or particles.", scoped=False),
    Option("search_width", positive_int("search_width"), 2, "--search beam/dvts: the beam width (divides search_n).",
           scoped=False),
    Option("search_max_steps", positive_int("search_max_steps"), 40, "--search: iterations (the last runs to EOS).",
           scoped=False),
    Option("temperature_fit", choice("temperature_fit", ("cv", "split")), "cv", "Where the calibration "
           "temperature is fitted: cv (10-fold cross-validation on the evaluated questions, no model work) or "
           "split (also run each multiple-choice task on its validation, else few-shot, split and fit there).",
           scoped=False),
)
BY_NAME = {o.name: o for o in OPTIONS}


def _searching(a) -> bool:
    return a.search != "none"


# option -> (when a value other than its default acts, what to give then): outside that it would do nothing
NEEDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "search_n": (_searching, "--search beam|dvts|particles"),
    "search_width": (lambda a: a.search in ("beam", "dvts"), "--search beam or dvts"),
    "search_max_steps": (_searching, "--search beam|dvts|particles"),
    "prm_aggregation": (_searching, "--search beam|dvts|particles (step-level search folds step scores)"),
    "prm": (lambda a: a.verifier is not None, "--verifier"),
    "step_separator": (lambda a: a.prm or _searching(a), "prm=true or --search"),
    "cascade": (lambda a: a.gen_path != "og", "gen_path=auto or raw (cascade is a raw-path decoding; gen_path=og "
                "generates on onnxruntime-genai)"),
    "shared_prefix_batch": (lambda a: a.prefix_cache and a.scoring_graph and not a.exact and a.path != "incremental",
                            "prefix_cache=true, scoring_graph=true, exact=false and path=auto or prefill (it batches "
                            "the prefill path's inputs that share a cached prefix; path=incremental scores on "
                            "onnxruntime-genai)"),
    "gen_batch_size": (lambda a: a.gen_path != "raw", "gen_path=auto or og (it batches onnxruntime-genai's "
                       "Generators; the raw path decodes a prompt's rows together by itself)"),
}


def check_settings(args) -> None:
    """Settings that would do nothing or harm beside the others: a one-line error naming them. A non-default
    value of an option in :data:`NEEDS` without what it acts under; ``threads`` above the cores of this machine
    where this process runs the sessions (more intra-op threads than cores only contend: 100000 grew memory
    for minutes with no progress)."""
    for name, (acts, what) in NEEDS.items():
        value = getattr(args, name)
        if value != BY_NAME[name].default and not acts(args):
            shown = ",".join(value) if isinstance(value, tuple) else value
            raise OrtEvalsError(f"{name}={shown!r} does nothing without {what}; drop it, or give "
                                f"{what.split(' (')[0]}")
    if args.search != "none" and args.samples:
        raise OrtEvalsError(f"--search {args.search} with --samples {args.samples}: a search already returns one "
                            f"answer a question, the best of search_n={args.search_n} candidates by the verifier's "
                            "step scores; give --search (its budget: search_n) or --samples K with --verifier "
                            "(best-of-K selections), not both")
    cores = os.cpu_count() or 1
    if args.threads and args.threads > cores and not (args.workers or args.ray_address):
        raise OrtEvalsError(f"threads={args.threads} is more than the {cores} CPU cores of this machine; expected "
                            f"0 (onnxruntime's default) to {cores}: more intra-op threads than cores only contend")
    _check_passes(args, cores)


def _check_passes(args, cores: int) -> None:
    """``passes=N`` (N > 1) acts only on the CPU prefill path in this process (``auto`` adapts instead)."""
    alone = ("--workers" if args.workers or args.ray_address else f"--ep {args.ep}" if args.ep not in (None, "cpu")
             else "path=incremental" if args.path == "incremental" else "")
    if args.passes > 1 and alone:
        raise OrtEvalsError(f"passes={args.passes} does nothing with {alone}: passes run at once only on the CPU "
                            "prefill path in this process; drop passes (or give passes=auto)")
    if args.passes > cores:
        raise OrtEvalsError(f"passes={args.passes} is more than the {cores} CPU cores of this machine; expected "
                            f"auto or 1 to {cores}: each pass takes a core")
    if args.passes > 1 and args.threads and args.passes * args.threads > cores and not alone:
        raise OrtEvalsError(f"passes={args.passes} with threads={args.threads} runs {args.passes * args.threads} "
                            f"intra-op threads at once on the {cores} CPU cores of this machine: they only contend; "
                            f"expected passes × threads <= {cores} (passes={args.passes} alone gives each pass one "
                            "thread)")


def check_provider(args, on_device: bool, provider: str) -> None:
    """Settings that act only on a device provider, refused once the run's provider is known (the package's own
    when ``--ep`` is not given)."""
    if args.allow_cpu_fallback and not on_device:
        raise OrtEvalsError(f"allow_cpu_fallback=true does nothing on the {provider} execution provider: every node "
                            "already runs on the CPU; drop it, or give --ep cuda (or another device provider)")

ModelArgs = dataclasses.make_dataclass(
    "ModelArgs", [(o.name, Any, dataclasses.field(default=o.default)) for o in OPTIONS], frozen=True,
    namespace={"__doc__": "ortevals model arguments (lm-eval ``model_args``, CLI, Olive); see :data:`OPTIONS`.",
               "__module__": __name__, "parse": staticmethod(lambda args: parse_model_args(args))},
)


def parse_model_args(args: Mapping[str, Any]) -> ModelArgs:
    """Raw values (strings from ``K=V,…`` or typed values) -> a validated :class:`ModelArgs`."""
    args = {k: v for k, v in args.items() if v is not None and k not in IGNORED}
    for alias in (*PKG_ALIASES, "path"):
        # `path` is also the scoring-path option: it names the package only when pkg is absent
        if alias in args and "pkg" not in args and (alias != "path" or args[alias] not in ("auto", "prefill",
                                                                                            "incremental")):
            args["pkg"] = args.pop(alias)
    if "pkg" not in args:
        raise OrtEvalsError("model_args needs pkg=PATH (the GenAI package folder)")
    unknown = sorted(set(args) - set(BY_NAME))
    if unknown:
        near = did_you_mean(unknown[0], BY_NAME)
        if not near and "provider_options" in args:  # lm-eval split `provider_options=a=1,b=2` at its comma
            raise OrtEvalsError(f"unknown ortevals model_args {unknown}: model_args are split at commas, so a "
                                f"second provider option became an argument of its own; separate provider options "
                                f"with ';' (provider_options={args['provider_options']};"
                                f"{unknown[0]}={args[unknown[0]]})")
        raise OrtEvalsError(f"unknown ortevals model_args {unknown}{near}; expected some of {sorted(BY_NAME)}")
    parsed = ModelArgs(**{k: BY_NAME[k].parse(v) for k, v in args.items()})
    check_settings(parsed)
    return parsed


def parse_arg_string(text: str | None) -> dict[str, str]:
    """``"k=v,k=v"`` (lm-eval's model_args syntax) -> dict; a bad pair names itself."""
    out: dict[str, str] = {}
    for pair in (text or "").split(","):
        if not pair.strip():
            continue
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise OrtEvalsError(f"--model-args entry {pair!r} must look like key=value")
        out[key.strip()] = value.strip()
    return out


def check_flags_agree(flags: Mapping[str, Any], model_args: Mapping[str, Any]) -> None:
    """A CLI flag and a ``--model-args`` entry for the same option must not disagree: one would be ignored."""
    for name, value in flags.items():
        if name in model_args:
            option = BY_NAME[name]
            if option.parse(value) != option.parse(model_args[name]):
                shown = ",".join(value) if isinstance(value, tuple) else value
                raise OrtEvalsError(f"{option.flag} {shown} and --model-args {name}={model_args[name]} disagree; "
                                    "give the option once")


def scoped_settings(args: ModelArgs) -> dict[str, Any]:
    """The arguments that can change a number, JSON-able: the settings part of the store's scope."""
    return {o.name: _jsonable(getattr(args, o.name)) for o in OPTIONS if o.scoped}


def _jsonable(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value

