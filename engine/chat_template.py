"""Chat templates of the agent endpoint: which template renders a policy's conversations into
text, and the tool-call format that goes with it (docs/agents.md).

`chat_format(tokenizer, spec)` resolves the rollout's `chat_template` setting:
- "auto" (default): the tokenizer's own `chat_template` when it has one (tool calls in
  Qwen2/Qwen3 `<tool_call>` tags); else the built-in "chatml" when the tokenizer spells every
  character of ChatML's markup (no unknown token), else the built-in "plain";
- "chatml": the project's Qwen2-style template: `<|im_start|>{role}\n{content}<|im_end|>\n`,
  the tools listed in the system turn, a tool call written as
  `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>` in the assistant turn, tool
  results in `<tool_response>` tags inside a user turn; the generation prompt is
  `<|im_start|>assistant\n`;
- "plain": for character-level models with a small vocabulary and short context (the tiny
  models): BOS, then each message as bare text: system and user content as written, the
  assistant's content then its calls as `name(argument)` then EOS, a tool result as
  `={content} `; no generation prompt. `12*34=` -> `calc(12*34)<eos>` -> `=408 ` -> `408<eos>`
  is a calculator episode;
- any other value: a file holding a Jinja chat template (tool calls in `<tool_call>` tags).

Templates are rendered by the tokenizer (`apply_chat_template(..., chat_template=...)`) with
`bos_token` / `eos_token` in scope. Invariant: a `ChatFormat` renders text only; turning text
into the tokens of an episode (and keeping sampled tokens verbatim) is engine/session.py's.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

CHATML = """\
{%- if messages and messages[0].role == 'system' %}{% set system = messages[0].content %}\
{% set rest = messages[1:] %}{% else %}{% set system = none %}{% set rest = messages %}{% endif %}
{%- if tools %}
<|im_start|>system
{{ system if system is not none else 'You are a helpful assistant.' }}

# Tools

You may call the functions described in <tools></tools>:
<tools>
{% for tool in tools %}
{{ tool | tojson }}
{% endfor %}
</tools>

To call one, write its name and arguments as a JSON object inside <tool_call></tool_call> tags:
<tool_call>
{"name": <function-name>, "arguments": <arguments-json-object>}
</tool_call><|im_end|>
{% elif system is not none %}
<|im_start|>system
{{ system }}<|im_end|>
{% endif %}
{%- for m in rest %}
{%- if m.role == 'assistant' %}
<|im_start|>assistant
{{ m.content or '' }}
{%- for call in m.tool_calls or [] %}
{%- set f = call.function if call.function is defined else call %}
{%- if m.content or not loop.first %}{{ '\\n' }}{% endif %}
<tool_call>
{"name": "{{ f.name }}", "arguments": \
{{ f.arguments if f.arguments is string else f.arguments | tojson }}}
</tool_call>
{%- endfor %}
<|im_end|>
{% elif m.role == 'tool' %}
{%- if loop.first or loop.previtem.role != 'tool' %}<|im_start|>user{% endif %}

<tool_response>
{{ m.content }}
</tool_response>
{%- if loop.last or loop.nextitem.role != 'tool' %}<|im_end|>
{% endif %}
{% else %}
<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""

PLAIN = """\
{{- bos_token or '' -}}
{%- for m in messages -%}
{%- if m.role == 'assistant' -%}
{{- m.content or '' -}}
{%- for call in m.tool_calls or [] -%}
{%- set f = call.function if call.function is defined else call -%}
{%- set a = f.arguments -%}
{{- f.name }}({{ (a.values() | first) if (a is mapping and a | length == 1 and \
(a.values() | first) is string) else ('' if (a is mapping and a | length == 0) else \
(a if a is string else a | tojson)) }})
{%- endfor -%}
{{- eos_token or '' -}}
{%- elif m.role == 'tool' -%}
={{ m.content }} {# -#}
{%- else -%}
{{- m.content -}}
{%- endif -%}
{%- endfor -%}"""

BUILTIN = {"chatml": (CHATML, "tags"), "plain": (PLAIN, "plain")}
SENTINEL = "\x00sentinel\x00"  # a content no conversation holds, to find the turn's closing


@dataclass
class ChatFormat:
    """A chat template, the tool-call format of its assistant turns, and how it closes one."""

    name: str  # "chatml", "plain", "tokenizer", or the template file
    template: str  # Jinja source
    tool_format: str  # "tags" | "plain" (envs.openai_api.parse_tool_calls)
    closing: str = field(default="")  # text the template puts after an assistant's content

    def render(self, tokenizer: Any, messages: list[dict], tools: list[dict] | None,
               add_generation_prompt: bool) -> str:
        """The conversation as text (not tokenized; special tokens spelled out)."""
        return tokenizer.apply_chat_template(messages, tools=tools or None,
                                             chat_template=self.template, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)


def check_chat_template(spec: str) -> None:
    """ValueError unless `spec` names a chat template ("auto", a built-in, or a file)."""
    if spec != "auto" and spec not in BUILTIN and not (isinstance(spec, str)
                                                       and os.path.isfile(spec)):
        raise ValueError(f"chat_template {spec!r}: use 'auto', 'chatml', 'plain' or the path of "
                         f"a file holding a Jinja chat template")


def chat_format(tokenizer: Any, spec: str = "auto") -> ChatFormat:
    """The ChatFormat for `spec` ("auto", "chatml", "plain" or a template file; see the module
    docstring); ValueError naming the spec when it is none of those or does not render."""
    if spec == "auto":
        own = getattr(tokenizer, "chat_template", None)
        if isinstance(own, str) and own:
            fmt = ChatFormat("tokenizer", own, "tags")
        else:
            fmt = _builtin("chatml" if _spells(tokenizer, CHATML_MARKUP) else "plain")
    elif spec in BUILTIN:
        fmt = _builtin(spec)
    elif isinstance(spec, str) and os.path.isfile(spec):
        with open(spec, encoding="utf-8") as f:
            fmt = ChatFormat(spec, f.read(), "tags")
    else:
        check_chat_template(spec)
        raise AssertionError("unreachable")
    try:
        fmt.closing = _closing(tokenizer, fmt)
    except Exception as e:  # a template's own error (undefined variable, raise_exception, ...)
        if fmt.name == "tokenizer":  # chosen by "auto": runs without agents must not fail here
            log.warning("the tokenizer's chat template does not render a user and an assistant "
                        "message (%s: %s); agent requests will be rendered as it allows",
                        type(e).__name__, e)
            return fmt
        raise ValueError(f"chat_template {fmt.name!r} does not render a user and an assistant "
                         f"message: {type(e).__name__}: {e}") from e
    return fmt


CHATML_MARKUP = "<|im_start|>system\nuser\nassistant\n<|im_end|>\n<tool_call>{\"name\": []}_"


def _builtin(name: str) -> ChatFormat:
    template, tool_format = BUILTIN[name]
    return ChatFormat(name, template, tool_format)


def _spells(tokenizer: Any, text: str) -> bool:
    """Whether the tokenizer encodes `text` without its unknown token."""
    unk = getattr(tokenizer, "unk_token_id", None)
    return unk is None or unk not in tokenizer.encode(text, add_special_tokens=False)


def _closing(tokenizer: Any, fmt: ChatFormat) -> str:
    """What the template writes after an assistant message's content ("" if it cannot tell)."""
    text = fmt.render(tokenizer, [{"role": "user", "content": "x"},
                                  {"role": "assistant", "content": SENTINEL}], None, False)
    at = text.rfind(SENTINEL)
    return "" if at < 0 else text[at + len(SENTINEL):]
