"""RawRowModel (engine/generate/search/rawrows.py, issue 25): the step-level searches on the raw engine give the
tokens a transformers model gives when it recomputes every row from scratch (same seeded choices, same
PRM), with the prompt run once and rows of different lengths."""

from __future__ import annotations

import numpy as np
import pytest

from ortevals.engine.generate.choice.settings import GenSettings
from ortevals.engine.generate.search.guided import SearchSettings, dvts, particle_filter, prm_beam_search
from ortevals.engine.generate.search.rawrows import RawRowModel
from ortevals.engine.generate.search.steps import ProcessorChooser, SampleChooser, StepRules
from ortevals.integrations.lm import ModelArgs, OrtLM
from ortevals.options import parse_model_args
from ortevals.run.search import search_sampling, search_settings

PROMPT = "Question: what is the river of the city? Answer: the river"


class TorchRowModel:
    """A RowModel over transformers: every step re-runs each row's whole sequence (no KV at all)."""

    def __init__(self, model) -> None:
        self.model, self.rows = model, []

    def _logits(self, seqs):
        import torch

        with torch.no_grad():
            return np.stack([self.model(input_ids=torch.tensor([s])).logits[0, -1].float().numpy() for s in seqs])

    def start(self, prompt, rows):
        self.rows = [list(prompt) for _ in range(rows)]
        return self._logits(self.rows)

    def fork(self, parents):
        self.rows = [list(self.rows[int(p)]) for p in parents]

    def step(self, tokens, rows):
        for t, r in zip(tokens, rows, strict=True):
            self.rows[int(r)].append(int(t))
        return self._logits([self.rows[int(r)] for r in rows])


class Prm:
    """A deterministic PRM: a step's score from its token ids (and its position), in (0, 1)."""

    def __init__(self) -> None:
        self.calls = 0

    def score(self, prompt, solutions):
        self.calls += 1
        return [[((sum(step) * 31 + 7 * i) % 97 + 1) / 99 for i, step in enumerate(steps)] for steps in solutions]


@pytest.fixture(scope="module")
def models(tiny, tiny_pkg):
    import torch
    from transformers import AutoModelForCausalLM

    lm = OrtLM.from_package(ModelArgs(pkg=str(tiny_pkg), max_length=256, gen_path="raw"))
    torch.set_num_threads(1)
    hf = AutoModelForCausalLM.from_pretrained(str(tiny[0]), dtype=torch.float32).eval()
    return lm, hf


RULES = StepRules(eos=frozenset({2}), ends_step=lambda step: step[-1] % 5 == 0, max_step_tokens=6, max_tokens=24)


@pytest.mark.parametrize("method", ["beam", "dvts", "particles"])
def test_searches_on_the_raw_engine_equal_transformers_from_scratch(models, method):
    lm, hf = models
    prompt = lm.tok_encode(PROMPT)
    settings = SearchSettings(n=4, width=2, max_steps=4, aggregation="min")
    outcomes = []
    for model in (RawRowModel(lm.run.generation.sampler().runner), TorchRowModel(hf)):
        chooser = SampleChooser(np.random.default_rng(7), temperature=1.0)
        if method == "beam":
            out = prm_beam_search(model, prompt, Prm(), RULES, chooser, settings)
        elif method == "dvts":
            out = dvts(model, prompt, Prm(), RULES, chooser, settings)
        else:
            out = particle_filter(model, prompt, Prm(), RULES, chooser, settings, np.random.default_rng(3))
        outcomes.append((model, out))
    (raw, a), (_, b) = outcomes
    assert [s.tokens for s in a.solutions] == [s.tokens for s in b.solutions]
    assert a.best == b.best and a.generated_tokens == b.generated_tokens and a.passes == b.passes
    np.testing.assert_allclose([s.logprob for s in a.solutions], [s.logprob for s in b.solutions], atol=1e-3)
    assert len({len(s.tokens) for s in a.solutions}) > 1  # rows of different lengths really ran
    assert raw.stats["prompt_tokens"] == len(prompt)  # the prompt ran once: forks copied KV, never re-ran it
    assert 0 < raw.stats["tokens_run"] <= a.generated_tokens  # each generated token fed once at most
    assert raw.stats["passes"] - 1 > a.passes  # rows of different lengths took a pass per length


class TorchOrm:
    """The tiny ORM in transformers: the score of context + text (the reference for the PRM's scorer)."""

    def __init__(self, hf_dir) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(hf_dir)
        self.model = AutoModelForSequenceClassification.from_pretrained(hf_dir, dtype=torch.float32).eval()

    def __call__(self, context, texts):
        import torch

        with torch.no_grad():
            return np.array([self.model(**self.tok(context + t, return_tensors="pt")).logits.item() for t in texts])


@pytest.mark.parametrize("method", ["beam", "particles"])
def test_search_option_answers_as_the_search_on_transformers(models, tiny_pkg, tiny_orm, method):
    """--search through OrtLM.generate_until (ORM-guided, steps at "."): the answer is the text of the same
    search run on transformers (the decoder and the ORM), seeded by the request's own generator."""
    from lm_eval.api.instance import Instance

    from ortevals.engine.generate.choice.seeds import sample_rng
    from ortevals.engine.generate.search.prm import TextPrm
    from ortevals.engine.generate.search.steps import text_separator
    from ortevals.report.resume import request_keys

    _, hf = models
    lm = OrtLM.from_package(ModelArgs(pkg=str(tiny_pkg), max_length=256, gen_path="raw", search=method,
                                      verifier=str(tiny_orm[1]), step_separator=".", search_n=4, search_width=2,
                                      search_max_steps=3, prm_aggregation="min"))
    gen = {"until": ["Question:"], "max_gen_toks": 20, "do_sample": False}
    request = Instance("generate_until", {}, (PROMPT, gen), 0)
    [text] = lm.generate_until([request], disable_tqdm=True)
    rng = sample_rng(1234, request_keys("generate_until", [request])[0], None)
    prompt = lm.tok_encode(PROMPT)
    rules = StepRules(frozenset({2}), text_separator(lm.tokenizer.decode, "."), max_step_tokens=20, max_tokens=20)
    prm = TextPrm(TorchOrm(tiny_orm[0]), ".", lm.tokenizer.decode)
    settings = SearchSettings(n=4, width=2, max_steps=3, aggregation="min", reward="raw")  # the ORM gives logits
    chooser = ProcessorChooser(search_sampling(GenSettings(max_gen_toks=20)), rng)  # greedy: sampled at T 0.8
    if method == "beam":
        out = prm_beam_search(TorchRowModel(hf), prompt, prm, rules, chooser, settings)
    else:
        out = particle_filter(TorchRowModel(hf), prompt, prm, rules, chooser, settings, rng)
    want = lm.tokenizer.decode(list(out.solutions[out.best].tokens), skip_special_tokens=True).split("Question:")[0]
    assert text == want and len(text) > 0


def test_search_takes_the_requests_processors(tiny_pkg, tiny_orm):
    """The request's gen_kwargs reach the search's token choice: with top_k=1 every row draws its argmax,
    so the search's answer is the greedy answer of the plain run (at temperature 1.5, where unfiltered
    draws of the tiny model wander)."""
    from lm_eval.api.instance import Instance

    common = {"pkg": str(tiny_pkg), "max_length": 256, "gen_path": "raw"}
    search = OrtLM.from_package(ModelArgs(**common, search="particles", verifier=str(tiny_orm[1]),
                                          step_separator=".", search_n=4, search_max_steps=3))
    plain = OrtLM.from_package(ModelArgs(**common))

    def answer(lm, **gen):
        request = Instance("generate_until", {}, (PROMPT, {"until": ["Question:"], "max_gen_toks": 20, **gen}), 0)
        return lm.generate_until([request], disable_tqdm=True)[0]

    greedy = answer(plain, do_sample=False)
    assert answer(search, do_sample=True, temperature=1.5, top_k=1) == greedy
    assert answer(search, do_sample=True, temperature=1.5) != greedy  # without the filter the draws differ


@pytest.mark.parametrize(("extra", "needle"), [
    (["--search", "beam"], "--search needs --verifier"),
    (["--search", "dvts", "--verifier", "self", "--model-args", "search_n=3"], "must be a multiple of the beam width"),
    (["--search", "particles", "--verifier", "self", "--model-args", "gen_path=og"], "runs on the raw path"),
])
def test_bad_search_options_are_one_line_errors(tiny_pkg, extra, needle):
    from click.testing import CliRunner

    from ortevals.cli import cli

    result = CliRunner().invoke(cli, ["mmlu-pro", "--pkg", str(tiny_pkg), "--data", "bundled", "--cot", "--limit", "1",
                                      "--max-gen-toks", "4", "--no-resume", "--truncate", "left", *extra],
                                catch_exceptions=False)
    assert result.exit_code == 2 and needle in result.output and len(result.output.strip().splitlines()) == 1, \
        result.output


@pytest.mark.parametrize("aggregation", ["last", "min", "prod"])
def test_the_prm_aggregation_option_reaches_the_search(aggregation):
    """``prm_aggregation`` from the options table is the search's fold of each solution's step scores
    (search/guided.py's judge reads ``SearchSettings.aggregation``); its default is search-and-learn's ``last``."""
    args = parse_model_args({"pkg": "x", "search": "beam", "search_n": "4", "search_width": "2",
                             "prm_aggregation": aggregation})
    assert search_settings(args).aggregation == aggregation
    assert search_settings(parse_model_args({"pkg": "x", "search": "beam", "search_n": "4",
                                             "search_width": "2"})).aggregation == "last"
