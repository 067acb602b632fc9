"""Chat templates (package/chat.py) render exactly as transformers' apply_chat_template: the templates
of several real model families (tests/chat_templates.py), multi-turn conversations, system prompts,
tool calls (tojson), add_generation_prompt on and off; and lm-eval hf's way of calling it."""

import json
import shutil

import pytest

from tests.chat_templates import FAMILIES

SYSTEM = {"role": "system", "content": "You are terse. Answer with <b>one</b> word & no 'quotes'."}
TURNS = [{"role": "user", "content": "What is the capital of France?"},
         {"role": "assistant", "content": "  Paris.  "},
         {"role": "user", "content": "And of Japan? Café, naïve, 日本 — “quoted” <tag> & 'x'"}]
TOOLS = [{"role": "user", "content": "Weather in Paris?"},
         {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
             "name": "get_weather", "arguments": {"city": "Paris <FR> & 'Île'", "unit": "°C"}}}]},
         {"role": "tool", "content": "{\"temp\": 21}"},
         {"role": "user", "content": "Thanks"}]
CONVERSATIONS = {
    "one turn": TURNS[:1],
    "system + one turn": [SYSTEM, *TURNS[:1]],
    "multi-turn": TURNS,
    "system + multi-turn": [SYSTEM, *TURNS],
    "ends with the assistant": TURNS[:2],
    "none-valued keys dropped": [{"role": "user", "content": "Hi", "name": None}],
    "reasoning": [TURNS[0], {"role": "assistant", "content": "Paris.", "reasoning": "France's capital."},
                  TURNS[2]],
}
TOOL_FAMILIES = ("llama-3.2", "qwen-2.5", "qwen-3")  # templates that render tool calls (tojson)


@pytest.fixture(scope="module")
def packages(tiny_pkg, tmp_path_factory):
    """One folder per family with the tiny package's tokenizer files: its tokenizer_config.json holds the
    family's template and special tokens (what the builder copies from the checkpoint)."""
    out = {}
    for name, (template, special) in FAMILIES.items():
        pkg = tmp_path_factory.mktemp(name)
        shutil.copy(tiny_pkg / "tokenizer.json", pkg / "tokenizer.json")
        config = json.loads((tiny_pkg / "tokenizer_config.json").read_text())
        config.update(special, chat_template=template)
        (pkg / "tokenizer_config.json").write_text(json.dumps(config))
        (pkg / "base.json").write_text(json.dumps({"package": str(tiny_pkg)}))  # the model the tokenizer serves
        out[name] = pkg
    return out


def load_tokenizer(folder):
    """ortevals' Tokenizer.load on the tokenizer files in ``folder`` (the tiny package's model otherwise)."""
    import dataclasses

    from ortevals.package.loader import ModelPackage
    from ortevals.package.tokenizer import Tokenizer

    base = ModelPackage.load(json.loads((folder / "base.json").read_text())["package"])
    return Tokenizer.load(dataclasses.replace(base, root=folder, tokenizer_dir=folder))


def both(pkg, messages, add_generation_prompt):
    """(ortevals' rendering, transformers' AutoTokenizer.apply_chat_template) of one conversation, or the
    exception each raised."""
    from transformers import AutoTokenizer

    ours = load_tokenizer(pkg)
    theirs = AutoTokenizer.from_pretrained(str(pkg))
    results = []
    for render in (lambda: ours.render_chat(messages, add_generation_prompt),
                   lambda: theirs.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt)):
        try:
            results.append(render())
        except Exception as e:  # noqa: BLE001  (a template refusing the conversation: both must refuse)
            results.append(type(e))
    return results


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_rendering_equals_transformers(packages, family, add_generation_prompt):
    conversations = dict(CONVERSATIONS)
    if family in TOOL_FAMILIES:
        conversations["tool call"] = TOOLS
    rendered = 0
    for name, messages in conversations.items():
        ours, theirs = both(packages[family], messages, add_generation_prompt)
        if isinstance(theirs, type):  # transformers refused it (Gemma 2: no system role): so do we, in one line
            from ortevals.package.chat import ChatTemplateError

            assert ours is ChatTemplateError, (name, ours)
            continue
        assert ours == theirs, (family, name)
        rendered += 1
    assert rendered >= 4


def test_what_the_old_environment_got_wrong(packages):
    """The three differences the plain sandbox had, each visible in a real template's output."""
    ours, theirs = both(packages["loop-controls"], [SYSTEM, *TURNS, TURNS[0], TURNS[1]], False)
    # the system message is skipped ({% continue %}) but counted by loop.index; {% break %} after the 4th
    assert ours == theirs == ("user: What is the capital of France?\nassistant:   Paris.  \nuser: And of Japan? "
                              "Café, naïve, 日本 — “quoted” <tag> & 'x'\n")
    ours, theirs = both(packages["qwen-2.5"], TOOLS, True)
    assert ours == theirs and '"city": "Paris <FR> & \'Île\'"' in ours  # tojson escaped <, >, & and ' as HTML
    from datetime import datetime

    ours, theirs = both(packages["llama-3.2"], TURNS, True)
    assert ours == theirs and f"Today Date: {datetime.now().strftime('%d %b %Y')}" in ours  # strftime_now


def test_the_jinja_file_wins_and_named_templates(packages, tmp_path):
    """transformers reads chat_template.jinja before tokenizer_config.json's chat_template, and a list of
    named templates uses "default"."""
    pkg = tmp_path / "pkg"
    shutil.copytree(packages["phi-4"], pkg)
    (pkg / "chat_template.jinja").write_text(FAMILIES["smollm2"][0])
    ours, theirs = both(pkg, TURNS, True)
    assert ours == theirs and ours.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    (pkg / "chat_template.jinja").unlink()
    config = json.loads((pkg / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "tool_use", "template": "TOOLS"},
                               {"name": "default", "template": FAMILIES["gemma-3"][0]}]
    (pkg / "tokenizer_config.json").write_text(json.dumps(config))
    assert load_tokenizer(pkg).chat_template == FAMILIES["gemma-3"][0]


@pytest.fixture(scope="module")
def hf_and_ours(tiny):
    """lm-eval's HFLM and ortevals' OrtLM on the tiny model, both given the same template and tokens."""
    from lm_eval.models.huggingface import HFLM

    from ortevals.integrations.lm import ModelArgs, OrtLM

    hf = HFLM(pretrained=str(tiny[0]), device="cpu", batch_size=1, dtype="float32", max_length=256)
    ours = OrtLM.from_package(ModelArgs(pkg=str(tiny[1]), max_length=256))
    return hf, ours


@pytest.mark.parametrize("family", ["gemma-2", "mistral-7b-v0.2", "llama-3.2", "smollm2", "qwen-3"])
def test_lm_eval_hf_apply_chat_template(hf_and_ours, family):
    """lm-eval's HFLM.apply_chat_template: continue_final_message when no generation prompt is asked for
    (a few-shot turn or an assistant prefix), and a template refusing the system role (Gemma 2, Mistral
    v0.2) tried again without it."""
    hf, ours = hf_and_ours
    template, special = FAMILIES[family]
    hf.tokenizer.chat_template = template
    ours.tokenizer.chat_template = template
    ours.tokenizer.template_vars = {**ours.tokenizer.template_vars, **{k: v for k, v in hf.tokenizer.
                                                                       special_tokens_map.items()}}
    for messages in ([SYSTEM, *TURNS], [SYSTEM, *TURNS[:2]], TURNS[:2], TURNS):
        for generation_prompt in (True, False):
            try:
                theirs = hf.apply_chat_template(messages, generation_prompt)
            except ValueError:  # continue_final_message on a user turn a template rewrites: both refuse
                with pytest.raises(ValueError):
                    ours.apply_chat_template(messages, generation_prompt)
                continue
            assert ours.apply_chat_template(messages, generation_prompt) == theirs, (messages, generation_prompt)
