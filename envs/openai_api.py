"""An OpenAI-compatible HTTP endpoint per episode, so agents written against the `openai` client
run inside RL episodes unchanged (docs/agents.md).

One `AgentEndpoint` (an aiohttp server on 127.0.0.1, ephemeral port) serves every episode of a
process under `/episodes/{key}/v1/...`, where `key` is an unguessable token given to the
episode's backend at `register()` and forgotten at `unregister()`:

    POST /episodes/{key}/v1/chat/completions   messages, tools, tool_choice, temperature, top_p,
                                               max_tokens / max_completion_tokens, n (= 1), stop,
                                               stream (+ stream_options.include_usage), logprobs
    POST /episodes/{key}/v1/completions        prompt (text, or token ids), the same options
    GET  /episodes/{key}/v1/models[/{id}]      the one model

A backend (`ChatBackend`: the rollout's `engine.session.HttpSession`, or the contract checker's
scripted one) turns a validated request into a `Completion`; this module owns the wire format:
request checks, response and stream bodies, and tool-call parsing (`parse_tool_calls`).

Invariant: every answer that is not a 2xx is an OpenAI error body
`{"error": {"message", "type", "param", "code"}}` (unknown episode key or route: 404; malformed
request: 400 naming the field in `param`; body too large: 413; wrong method: 405; a backend
failure: 500), so the `openai` client raises its usual exceptions. Streaming answers are
complete before they start (the completion is generated first, then sent as server-sent-event
chunks ending with `data: [DONE]`).
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from aiohttp import web

from transport.errors import RlxError
from transport.http import start_http, stop_http

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 16 << 20  # a request body larger than this is refused with 413
MAX_STOP = 4  # stop sequences per request (OpenAI's limit)
ROLES = ("system", "developer", "user", "assistant", "tool")
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
TOOL_FORMATS = ("tags", "plain")

# Request fields: handled, or accepted only at their default (anything else is a 400).
CHAT_FIELDS = {"model", "messages", "tools", "tool_choice", "temperature", "top_p", "max_tokens",
               "max_completion_tokens", "n", "stop", "stream", "stream_options", "logprobs",
               "top_logprobs", "seed", "parallel_tool_calls"}
COMPLETION_FIELDS = {"model", "prompt", "temperature", "top_p", "max_tokens", "n", "stop",
                     "stream", "stream_options", "logprobs", "seed"}
IGNORED_FIELDS = {"user", "metadata", "store", "service_tier"}
DEFAULT_ONLY = {"presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0),
                "logit_bias": ({},), "response_format": ({"type": "text"},), "echo": (False,),
                "suffix": ("",), "best_of": (1,)}


class OpenAIError(RlxError):
    """An answer in OpenAI's error format; `param` names the offending request field."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (status, message, type,
                                                                       param, code)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


# ----------------------------------------------------------------------------- requests
@dataclass(kw_only=True)
class GenerationRequest:
    """What chat and text completion requests share: the model and how to generate."""

    model: str
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    seed: int | None = None


@dataclass(kw_only=True)
class ChatRequest(GenerationRequest):
    """A validated /v1/chat/completions request (messages normalized: see `parse_messages`)."""

    messages: list[dict]
    tools: list[dict] | None = None
    tool_choice: str = "auto"  # "auto" | "none"


@dataclass(kw_only=True)
class CompletionRequest(GenerationRequest):
    """A validated /v1/completions request; `prompt` is text or a list of token ids."""

    prompt: str | list[int]


@dataclass
class Completion:
    """What a backend generated for one request."""

    text: str  # the visible text (a matched stop sequence and <eos> trimmed)
    finish_reason: str  # "stop" | "length" | "tool_calls"
    prompt_tokens: int
    completion_tokens: int
    content: str | None = None  # chat: text outside tool calls (None when only tool calls)
    tool_calls: list[dict] = field(default_factory=list)  # chat: OpenAI tool_calls entries
    token_texts: list[str] = field(default_factory=list)  # per sampled token (for logprobs)
    token_logprobs: list[float] = field(default_factory=list)


class ChatBackend(Protocol):
    """What the endpoint serves for one episode. A 4xx answer to one of its requests (the
    agent's mistake, or the inference server's refusal) is also reported to `refused`."""

    model_id: str

    async def chat_completion(self, request: ChatRequest) -> Completion: ...

    async def text_completion(self, request: CompletionRequest) -> Completion: ...

    def refused(self, error: OpenAIError) -> None: ...


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: Any) -> bool:
    return (_is_int(x) or isinstance(x, float)) and x == x and abs(x) != float("inf")


def _number(body: dict, key: str, lo: float, hi: float) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if not _is_num(value) or not lo <= value <= hi:
        raise bad(f"{value!r} is not valid for '{key}': expected a number in [{lo}, {hi}]", key)
    return float(value)


def _positive_int(body: dict, key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if not _is_int(value) or value < 1:
        raise bad(f"{value!r} is not valid for '{key}': expected an integer >= 1", key)
    return value


def _bool(body: dict, key: str) -> bool:
    value = body.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad(f"{value!r} is not valid for '{key}': expected true or false", key)
    return value


def _stop(body: dict) -> list[str]:
    value = body.get("stop")
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
        raise bad("'stop' must be a non-empty string or a list of them", "stop")
    if len(value) > MAX_STOP:
        raise bad(f"'stop' takes at most {MAX_STOP} sequences, got {len(value)}", "stop")
    return value


def _check_fields(body: Any, known: set[str]) -> None:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    for key in body:
        if key in known or key in IGNORED_FIELDS:
            continue
        if key in DEFAULT_ONLY:
            if body[key] is not None and body[key] not in DEFAULT_ONLY[key]:
                raise bad(f"'{key}' = {body[key]!r} is not supported inside an RL episode "
                          f"(only its default)", key)
            continue
        raise bad(f"Unrecognized request argument supplied: {key}", key)
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise bad("'model' is required: a non-empty string (any name; the episode's policy "
                  "answers)", "model")
    n = body.get("n")
    if n is not None and n != 1:
        raise bad(f"n = {n!r}: inside an RL episode a request has exactly one completion (only "
                  f"one can continue the episode's trajectory); send n = 1 and ask again for "
                  f"another sample", "n")


def _stream_options(body: dict) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise bad("'stream_options' must be an object with 'include_usage' only",
                  "stream_options")
    if not body.get("stream"):
        raise bad("'stream_options' is only allowed when 'stream' is true", "stream_options")
    return _bool(options, "include_usage")


def _sampling(body: dict) -> dict:
    seed = body.get("seed")
    if seed is not None and not _is_int(seed):
        raise bad(f"{seed!r} is not valid for 'seed': expected an integer", "seed")
    return {"temperature": _number(body, "temperature", 0.0, 2.0),
            "top_p": _number(body, "top_p", 0.0, 1.0), "stop": _stop(body),
            "stream": _bool(body, "stream"), "include_usage": _stream_options(body),
            "seed": seed}


def parse_chat_request(body: Any) -> ChatRequest:
    """A /v1/chat/completions body -> ChatRequest; OpenAIError(400) naming the field."""
    _check_fields(body, CHAT_FIELDS)
    top = body.get("top_logprobs")
    if top not in (None, 0):
        raise bad("'top_logprobs' > 0 is not served inside an RL episode; 'logprobs': true "
                  "gives the sampled tokens' log-probs", "top_logprobs")
    max_tokens = _positive_int(body, "max_completion_tokens")
    if max_tokens is None:
        max_tokens = _positive_int(body, "max_tokens")
    tools = parse_tools(body.get("tools"))
    choice = body.get("tool_choice")
    if choice is None:
        choice = "auto"
    if choice not in ("auto", "none"):
        raise bad(f"tool_choice {choice!r} is not supported: generation is not constrained "
                  f"inside an RL episode; use 'auto' (or 'none')", "tool_choice")
    return ChatRequest(model=body["model"], messages=parse_messages(body.get("messages")),
                       tools=tools, tool_choice=choice, max_tokens=max_tokens,
                       logprobs=_bool(body, "logprobs"), **_sampling(body))


def parse_completion_request(body: Any) -> CompletionRequest:
    """A /v1/completions body -> CompletionRequest; OpenAIError(400) naming the field."""
    _check_fields(body, COMPLETION_FIELDS)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list):
        if not prompt or not all(_is_int(t) and t >= 0 for t in prompt):
            raise bad("'prompt' must be a string, a list of token ids, or a list of one of "
                      "those (one prompt per request inside an RL episode)", "prompt")
    elif not isinstance(prompt, str) or not prompt:
        raise bad("'prompt' must be a non-empty string or a list of token ids", "prompt")
    logprobs = body.get("logprobs")
    if logprobs not in (None, 0):
        raise bad("'logprobs' > 0 (top log-probs) is not served inside an RL episode; "
                  "'logprobs': 0 gives the sampled tokens' log-probs", "logprobs")
    return CompletionRequest(model=body["model"], prompt=prompt,
                             max_tokens=_positive_int(body, "max_tokens"),
                             logprobs=logprobs == 0, **_sampling(body))


def parse_tools(tools: Any) -> list[dict] | None:
    """The request's tools, checked: [{"type": "function", "function": {"name", ...}}]."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad("'tools' must be a list", "tools")
    names = set()
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(
                fn, dict):
            raise bad(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}",
                      f"tools[{i}]")
        name = fn.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise bad(f"tools[{i}].function.name must match [A-Za-z0-9_-]{{1,64}}, got {name!r}",
                      f"tools[{i}].function.name")
        if name in names:
            raise bad(f"tools[{i}]: the function name {name!r} repeats", f"tools[{i}]")
        names.add(name)
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise bad(f"tools[{i}].function.parameters must be a JSON schema object",
                      f"tools[{i}].function.parameters")
    return tools or None


def _text(content: Any, where: str) -> str | None:
    """Message content as text: a string, or a list of text parts joined."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(
                    part.get("text"), str):
                raise bad(f"{where}.content: only text parts ({{'type': 'text', 'text': ...}}) "
                          f"are supported", f"{where}.content")
            parts.append(part["text"])
        return "".join(parts)
    raise bad(f"{where}.content must be a string or a list of text parts", f"{where}.content")


def parse_arguments(arguments: Any) -> Any:
    """A tool call's arguments as the templates want them: a JSON object string becomes the
    object; anything else stays as it is."""
    if isinstance(arguments, str):
        try:
            value = json.loads(arguments)
        except ValueError:
            return arguments
        return value if isinstance(value, dict) else arguments
    return arguments


def parse_messages(messages: Any) -> list[dict]:
    """The conversation, checked and normalized for chat templates: role "developer" becomes
    "system", content is text (or None for an assistant turn with tool calls), tool-call
    arguments are objects; fields other than role, content, name, tool_call_id, tool_calls and
    reasoning_content are dropped (the `openai` client sends refusal, audio, ... as null)."""
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            role = m.get("role") if isinstance(m, dict) else None
            raise bad(f"{where}.role must be one of {list(ROLES)}, got {role!r}", f"{where}.role")
        role = "system" if m["role"] == "developer" else m["role"]
        msg: dict[str, Any] = {"role": role, "content": _text(m.get("content"), where)}
        if role == "assistant":
            calls = m.get("tool_calls") or []
            if not isinstance(calls, list):
                raise bad(f"{where}.tool_calls must be a list", f"{where}.tool_calls")
            if calls:
                msg["tool_calls"] = [_tool_call(c, f"{where}.tool_calls[{j}]")
                                     for j, c in enumerate(calls)]
            elif msg["content"] is None:
                raise bad(f"{where}: an assistant message needs content or tool_calls",
                          f"{where}.content")
            if isinstance(m.get("reasoning_content"), str):
                msg["reasoning_content"] = m["reasoning_content"]
        elif msg["content"] is None:
            raise bad(f"{where}.content is required for role {m['role']!r}", f"{where}.content")
        if role == "tool":
            if not isinstance(m.get("tool_call_id"), str):
                raise bad(f"{where}.tool_call_id is required for role 'tool'",
                          f"{where}.tool_call_id")
            msg["tool_call_id"] = m["tool_call_id"]
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        out.append(msg)
    return out


def _tool_call(call: Any, where: str) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad(f"{where} must be {{'id', 'type': 'function', 'function': {{'name', "
                  f"'arguments'}}}}", where)
    arguments = fn.get("arguments", "{}")
    if not isinstance(arguments, (str, dict)):
        raise bad(f"{where}.function.arguments must be a JSON string", f"{where}.function")
    return {"id": str(call.get("id") or ""), "type": "function",
            "function": {"name": fn["name"], "arguments": parse_arguments(arguments)}}


def same_assistant_message(sent: dict, returned: dict) -> bool:
    """Whether an assistant message the agent sent back (normalized) is the one the endpoint
    returned: same text (None and "" alike) and the same tool calls (name and arguments compared
    as parsed JSON; ids and whitespace ignored)."""
    if sent.get("role") != "assistant":
        return False
    if (sent.get("content") or "") != (returned.get("content") or ""):
        return False
    a, b = sent.get("tool_calls") or [], returned.get("tool_calls") or []
    return len(a) == len(b) and all(
        x["function"]["name"] == y["function"]["name"]
        and parse_arguments(x["function"]["arguments"]) == parse_arguments(
            y["function"]["arguments"]) for x, y in zip(a, b))


# ----------------------------------------------------------------------------- tool calls
TAGGED_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def _call(name: str, arguments: dict) -> dict:
    return {"id": new_call_id(), "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def parse_tool_calls(text: str, tool_format: str,
                     tools: list[dict] | None) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of generated text; no tools, or no call found: (text, []).

    "tags" (Qwen2 / Qwen3 conventions): each `<tool_call>{"name": ..., "arguments": {...}}
    </tool_call>` whose JSON parses and names a tool of the request is a call; the text outside
    the parsed calls, stripped, is the content (None when empty). "plain" (the built-in template
    of character-level models): `name(text)` for a tool of the request is a call whose arguments
    are {first parameter: text} ({} for a tool without parameters). A malformed call stays text.
    """
    if tool_format not in TOOL_FORMATS:
        raise ValueError(f"unknown tool format {tool_format!r}; use one of {TOOL_FORMATS}")
    if not tools:
        return text, []
    specs = {t["function"]["name"]: t["function"] for t in tools}
    if tool_format == "tags":
        matches = [(m, _tagged(m.group(1), specs)) for m in TAGGED_CALL.finditer(text)]
    else:
        names = "|".join(re.escape(n) for n in sorted(specs, key=len, reverse=True))
        pattern = re.compile(rf"(?<![A-Za-z0-9_-])({names})\(([^()]*)\)")
        matches = [(m, _call(m.group(1), _plain_arguments(specs[m.group(1)], m.group(2))))
                   for m in pattern.finditer(text)]
    calls, kept, pos = [], [], 0
    for m, call in matches:
        if call is None:
            continue
        kept.append(text[pos:m.start()])
        pos = m.end()
        calls.append(call)
    if not calls:
        return text, []
    kept.append(text[pos:])
    return "".join(kept).strip() or None, calls


def _tagged(body: str, specs: dict) -> dict | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or value.get("name") not in specs:
        return None
    arguments = parse_arguments(value.get("arguments", value.get("parameters", {})))
    return _call(value["name"], arguments) if isinstance(arguments, dict) else None


def first_parameter(spec: dict) -> str | None:
    """The parameter a "plain" call's text fills: the first required one, else the first."""
    params = spec.get("parameters") or {}
    props = params.get("properties") or {}
    required = [p for p in params.get("required") or [] if p in props]
    return (required or list(props) or [None])[0]


def _plain_arguments(spec: dict, text: str) -> dict:
    name = first_parameter(spec)
    return {} if name is None else {name: text}


# ----------------------------------------------------------------------------- responses
def _usage(c: Completion) -> dict:
    return {"prompt_tokens": c.prompt_tokens, "completion_tokens": c.completion_tokens,
            "total_tokens": c.prompt_tokens + c.completion_tokens}


def _chat_logprobs(c: Completion) -> dict:
    return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode("utf-8")),
                         "top_logprobs": []} for t, lp in zip(c.token_texts, c.token_logprobs)],
            "refusal": None}


def _text_logprobs(c: Completion) -> dict:
    offsets, at = [], 0
    for t in c.token_texts:
        offsets.append(at)
        at += len(t)
    return {"tokens": list(c.token_texts), "token_logprobs": list(c.token_logprobs),
            "text_offset": offsets}


def chat_response(req: ChatRequest, c: Completion, rid: str, created: int) -> dict:
    message: dict[str, Any] = {"role": "assistant", "content": c.content}
    if c.tool_calls:
        message["tool_calls"] = c.tool_calls
    return {"id": rid, "object": "chat.completion", "created": created, "model": req.model,
            "choices": [{"index": 0, "message": message,
                         "logprobs": _chat_logprobs(c) if req.logprobs else None,
                         "finish_reason": c.finish_reason}],
            "usage": _usage(c)}


def chat_chunks(req: ChatRequest, c: Completion, rid: str, created: int) -> list[dict]:
    """The stream of one chat completion: the role, the content a token at a time (when the
    text is the content: no tool calls), each tool call whole, the finish reason, the usage."""
    def chunk(delta: dict, finish: str | None = None, logprobs: dict | None = None) -> dict:
        return {"id": rid, "object": "chat.completion.chunk", "created": created,
                "model": req.model, "choices": [{"index": 0, "delta": delta,
                                                 "logprobs": logprobs, "finish_reason": finish}]}

    out = [chunk({"role": "assistant", "content": ""},
                 logprobs=_chat_logprobs(c) if req.logprobs else None)]
    if c.content:
        pieces = _pieces(c.content, c.token_texts) if not c.tool_calls else [c.content]
        out += [chunk({"content": p}) for p in pieces]
    for i, call in enumerate(c.tool_calls):
        out.append(chunk({"tool_calls": [{"index": i, **call}]}))
    out.append(chunk({}, c.finish_reason))
    if req.include_usage:
        out.append({"id": rid, "object": "chat.completion.chunk", "created": created,
                    "model": req.model, "choices": [], "usage": _usage(c)})
    return out


def _pieces(text: str, token_texts: list[str]) -> list[str]:
    """`text` cut where the token texts fall (when they spell it), else in one piece."""
    pieces, at = [], 0
    for t in token_texts:
        if not t:
            continue
        if text.startswith(t, at):
            pieces.append(t)
            at += len(t)
        else:
            break
    if at < len(text):
        pieces.append(text[at:])
    return pieces


def completion_response(req: CompletionRequest, c: Completion, rid: str, created: int) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": req.model,
            "choices": [{"index": 0, "text": c.text,
                         "logprobs": _text_logprobs(c) if req.logprobs else None,
                         "finish_reason": c.finish_reason}],
            "usage": _usage(c)}


def completion_chunks(req: CompletionRequest, c: Completion, rid: str,
                      created: int) -> list[dict]:
    def chunk(text: str, finish: str | None = None) -> dict:
        return {"id": rid, "object": "text_completion", "created": created, "model": req.model,
                "choices": [{"index": 0, "text": text, "logprobs": None,
                             "finish_reason": finish}]}

    out = [chunk(p) for p in _pieces(c.text, c.token_texts)]
    out.append(chunk("", c.finish_reason))
    if req.logprobs:
        out[0]["choices"][0]["logprobs"] = _text_logprobs(c)
    if req.include_usage:
        out.append({"id": rid, "object": "text_completion", "created": created,
                    "model": req.model, "choices": [], "usage": _usage(c)})
    return out


# ----------------------------------------------------------------------------- the server
def error_response(e: OpenAIError) -> web.Response:
    return web.json_response(e.body(), status=e.status)


@web.middleware
async def _openai_errors(request: web.Request, handler) -> web.StreamResponse:
    """Every failure as an OpenAI error body."""
    try:
        return await handler(request)
    except OpenAIError as e:
        return error_response(e)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        kind = {404: "not_found_error", 405: "invalid_request_error",
                413: "invalid_request_error"}.get(e.status, "invalid_request_error")
        message = {404: f"Unknown route {request.method} {request.path}",
                   405: f"Method {request.method} not allowed on {request.path}",
                   413: "the request body is too large"}.get(e.status, e.reason)
        return error_response(OpenAIError(e.status, message, kind))
    except Exception as e:  # noqa: BLE001 - a backend failure answers 500, the server goes on
        log.warning("agent endpoint: %s %s failed: %s: %s", request.method, request.path,
                    type(e).__name__, e)
        return error_response(OpenAIError(500, f"{type(e).__name__}: {e}", "server_error"))


class AgentEndpoint:
    """The OpenAI-compatible server of one process; episodes register a backend each.

    Use inside the event loop: `await start()`, `register(backend) -> key`,
    `base_url(key)`, `unregister(key)`, `await close()`."""

    def __init__(self, host: str = "127.0.0.1", max_body_bytes: int = MAX_BODY_BYTES):
        self.host, self.max_body_bytes = host, max_body_bytes
        self.port = 0
        self._backends: dict[str, ChatBackend] = {}
        self._runner: web.AppRunner | None = None
        self.app = web.Application(middlewares=[_openai_errors], client_max_size=max_body_bytes)
        v1 = "/episodes/{key}/v1"
        self.app.router.add_post(v1 + "/chat/completions", self._chat)
        self.app.router.add_post(v1 + "/completions", self._completions)
        self.app.router.add_get(v1 + "/models", self._models)
        self.app.router.add_get(v1 + "/models/{model:.+}", self._model)

    async def start(self) -> None:
        self._runner, self.port = await start_http(self.app, self.host, 0)

    async def close(self) -> None:
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await stop_http(runner)
        self._backends.clear()

    @property
    def started(self) -> bool:
        return self._runner is not None

    def register(self, backend: ChatBackend) -> str:
        if not self.started:
            raise RuntimeError("the agent endpoint is not started; await start() first")
        key = secrets.token_urlsafe(18)
        self._backends[key] = backend
        return key

    def unregister(self, key: str) -> None:
        self._backends.pop(key, None)

    def base_url(self, key: str) -> str:
        """What to give `openai.AsyncOpenAI(base_url=...)`."""
        return f"http://{self.host}:{self.port}/episodes/{key}/v1"

    @property
    def episodes(self) -> int:
        return len(self._backends)

    # ------------------------------------------------------------------ handlers
    def _backend(self, request: web.Request) -> ChatBackend:
        backend = self._backends.get(request.match_info["key"])
        if backend is None:
            raise OpenAIError(404, "Unknown episode: this base_url belongs to no running "
                              "episode (it is valid from session.base_url until the episode "
                              "ends)", "not_found_error", code="episode_not_found")
        return backend

    async def _body(self, request: web.Request) -> Any:
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise OpenAIError(413, f"the request body is larger than {self.max_body_bytes} "
                              f"bytes") from None
        try:
            return json.loads(raw)
        except (ValueError, RecursionError) as e:
            raise bad(f"We could not parse the JSON body of your request: {e}") from None

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_chat_request, "chat_completion", "chatcmpl-",
                                    chat_chunks, chat_response)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_completion_request, "text_completion",
                                    "cmpl-", completion_chunks, completion_response)

    async def _generate(self, request: web.Request, parse, method: str, id_prefix: str,
                        chunks, response) -> web.StreamResponse:
        """One completion request of either kind: parse, generate through the episode's
        backend (`method`), answer whole or as server-sent events."""
        backend = self._backend(request)
        try:
            req = parse(await self._body(request))
            completion = await getattr(backend, method)(req)
        except OpenAIError as e:
            _refused(backend, e)
            raise
        rid, created = id_prefix + secrets.token_hex(12), int(time.time())
        if req.stream:
            return await _sse(request, chunks(req, completion, rid, created))
        return web.json_response(response(req, completion, rid, created))

    def _model_entry(self, backend: ChatBackend) -> dict:
        return {"id": backend.model_id, "object": "model", "created": 0, "owned_by": "rlx"}

    async def _models(self, request: web.Request) -> web.Response:
        entry = self._model_entry(self._backend(request))
        return web.json_response({"object": "list", "data": [entry]})

    async def _model(self, request: web.Request) -> web.Response:
        backend = self._backend(request)
        if request.match_info["model"] != backend.model_id:
            raise OpenAIError(404, f"The model {request.match_info['model']!r} does not exist; "
                              f"this episode serves {backend.model_id!r}", "not_found_error",
                              "model", "model_not_found")
        return web.json_response(self._model_entry(backend))


def _refused(backend: ChatBackend, error: OpenAIError) -> None:
    if error.status < 500 and callable(getattr(backend, "refused", None)):
        backend.refused(error)


async def _sse(request: web.Request, chunks: list[dict]) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
    await response.prepare(request)
    try:
        for chunk in chunks:
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
    except ConnectionError:  # the agent went away mid-stream; the completion is recorded
        log.info("agent endpoint: %s: the client left during the stream", request.path)
    return response
