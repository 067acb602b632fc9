"""Chat templates rendered exactly as transformers' ``apply_chat_template`` renders them.

Owns the jinja environment, the template variables and the call, so a prompt is the same string
lm-eval's hf backend builds, without importing transformers or torch at run time. A
reimplementation of transformers 5.x ``utils/chat_template_utils.py``
(``_cached_compile_jinja_template`` and ``render_jinja_template``) and of
``PreTrainedTokenizerBase.apply_chat_template`` / ``get_chat_template``
(Copyright The HuggingFace Team, Apache License 2.0):

* ``ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)`` with the
  ``loopcontrols`` extension (``{% break %}``, ``{% continue %}``) and the ``{% generation %}``
  block tag (rendered as its body: assistant masks are not tracked here);
* a ``tojson`` filter that is ``json.dumps(x, ensure_ascii=False, indent, separators,
  sort_keys)`` (jinja's own escapes ``<``, ``>``, ``&`` and ``'`` as HTML);
* globals ``raise_exception`` (a template error), ``strftime_now(fmt)`` (the local time now),
  ``dict`` and ``namespace`` restricted as there (no ``_``-prefixed names on a namespace);
* the call: message keys whose value is None dropped, the reasoning aliases
  (``reasoning_content``/``thinking``/``reasoning``), every named special token of the tokenizer
  config as a variable, ``tools`` and ``documents`` None, and ``continue_final_message``
  (lm-eval's hf backend passes ``not add_generation_prompt``): the text after the final
  message's content is cut.

The template itself is chosen as transformers chooses it: ``chat_template.jinja`` first, then
``tokenizer_config.json``'s ``chat_template`` (a string, or a list of named templates: "default").
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

from ortevals.errors import PackageError

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class ChatTemplateError(PackageError):
    """The template refused the conversation (``raise_exception``) or failed to render: one line."""


def choose_template(config_value: Any, jinja_file_text: str | None) -> str | None:
    """The template transformers uses: the ``chat_template.jinja`` file, else the config's string, else
    the config's named template "default"."""
    if jinja_file_text is not None:
        return jinja_file_text
    if isinstance(config_value, str):
        return config_value
    if isinstance(config_value, list):
        named = {t.get("name"): t.get("template") for t in config_value if isinstance(t, dict)}
        return named.get("default") if isinstance(named.get("default"), str) else None
    return None


def special_token_vars(config: Mapping[str, Any]) -> dict[str, str]:
    """transformers' ``special_tokens_map``: each named special token of the tokenizer config, as text."""
    out = {}
    for name in SPECIAL_TOKENS:
        value = config.get(name)
        if isinstance(value, dict):  # {"content": "<s>", ...} (AddedToken) in older configs
            value = value.get("content")
        if isinstance(value, str):
            out[name] = value
    return out


def render(template: str, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
           continue_final_message: bool = False, variables: Mapping[str, Any] | None = None) -> str:
    """One conversation through ``template`` as ``apply_chat_template(..., tokenize=False)`` renders it.

    ``variables``: the special tokens (:func:`special_token_vars`) and any extra template kwargs."""
    import jinja2

    if continue_final_message and add_generation_prompt:
        raise ChatTemplateError("continue_final_message and add_generation_prompt are not compatible")
    chat = _alias_reasoning([{k: v for k, v in dict(m).items() if v is not None} for m in messages])
    final = None
    if continue_final_message:
        if not chat or not isinstance(chat[-1].get("content"), str):
            raise ChatTemplateError("continue_final_message is set but the final message has no text to continue")
        final = chat[-1]["content"]
        chat[-1] = {**chat[-1], "content": final + CONTINUE_TAG}
    try:
        text = _compile(template).render(messages=chat, tools=None, documents=None,
                                         add_generation_prompt=add_generation_prompt, **dict(variables or {}))
    except jinja2.TemplateError as e:  # raise_exception and syntax/sandbox errors alike
        raise ChatTemplateError(f"chat template: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    return _cut_after_final(text, final) if continue_final_message else text


def _cut_after_final(text: str, final: str) -> str:
    """transformers' continue_final_message: everything after the final message's content goes."""
    if final.strip() not in text or CONTINUE_TAG.strip() not in text:
        raise ChatTemplateError("continue_final_message is set but the template dropped part of the final message")
    at = text.rindex(CONTINUE_TAG.strip())
    return text[:at] if text[at:at + len(CONTINUE_TAG)] == CONTINUE_TAG else text[:at].rstrip()


def _alias_reasoning(chat: list[dict]) -> list[dict]:
    """``reasoning_content`` and ``thinking`` filled from whichever reasoning field a message has."""
    out = []
    for m in chat:
        reasoning = next((m[k] for k in REASONING_FIELDS if m.get(k) is not None), None)
        out.append({"thinking": reasoning, **m, "reasoning_content": reasoning} if reasoning is not None else m)
    return out


@lru_cache(maxsize=16)
def _compile(template: str):
    """The template compiled in transformers' environment (cached per template text)."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_generation_tag(), loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_TemplateDict(),
                       namespace=_namespace_class())
    return env.from_string(template)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message):
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """``dict(...)`` and ``dict.fromkeys`` only: no attribute access to the dict type itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


def _namespace_class():
    """jinja's Namespace refusing ``_``-prefixed names (no route to CPython internals)."""
    import jinja2
    from jinja2.utils import Namespace

    def check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}.")

    class TemplateNamespace(Namespace):
        def __init__(*args, **kwargs):  # jinja's signature trick: namespace(self=...) still works
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                check(name)
            Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            check(name)
            Namespace.__setitem__(self, name, value)

    return TemplateNamespace


def _generation_tag():
    """The ``{% generation %}…{% endgeneration %}`` block (transformers' AssistantTracker): its body,
    unchanged (the assistant-token mask it can track is not used for prompts)."""
    import jinja2
    from jinja2.ext import Extension

    class GenerationBlock(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    return GenerationBlock
