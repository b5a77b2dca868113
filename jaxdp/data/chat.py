"""Instruction records rendered as text pieces that know whether the loss counts them.

A record is one of
  {"prompt": str, "completion": str}                      -> prompt (context), completion + end-of-text (counted)
  {"messages": [{"role": "system" | "user" | "assistant", "content": str}, ...]}
                                                          -> every assistant turn counted, the rest context

`segments(record, template)` returns [(text, counted)], in order: what the record's training window is and which
of its characters the loss counts (`jaxdp.data.instructions` tokenises the text between end-of-text tokens whole,
as inference would, and counts a token when a character of it is counted).

A conversation is rendered with the checkpoint's chat template (`ChatTemplate.from_directory`: the
`chat_template` of `tokenizer_config.json`, or a `chat_template.jinja` beside it), as Hugging Face
`apply_chat_template` does (Jinja2 sandbox, `trim_blocks`, `lstrip_blocks`, `raise_exception`, `tojson`,
`{% generation %}` blocks, the tokenizer's special tokens as variables; `strftime_now` renders one fixed
date, so a record renders the same in every run, which a resume checks). Assistant turn i spans the text
between the rendering of turns [0, i) with the generation prompt and the rendering of turns [0, i]: its
content and the template's end-of-turn text are counted, the generation prompt (e.g.
"<|im_start|>assistant\n") is context. A template that does not render a conversation prefix by prefix (the
rendering of turns [0, i] is not the start of the whole) is refused for that record: the counted tokens would
not be the ones trained on.

Without a template, the documented plain one (`PLAIN_HEADERS`): each turn is `"<Role>: "` and its content; a
system or user turn ends with a blank line, an assistant turn's content is followed by the end-of-text token
(counted, so the model learns to stop) and a blank line. The header "Assistant: " is context.

Jinja2 is needed only for a checkpoint with a chat template (`pip install jaxdp[chat]`).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import pathlib

ROLES = ("system", "user", "assistant")
PLAIN_HEADERS = {"system": "System: ", "user": "User: ", "assistant": "Assistant: "}
PLAIN_TURN_END = "\n\n"
EOT = object()  # stands for the tokenizer's end-of-text token in a segment list
_FIXED_NOW = datetime.datetime(2024, 7, 26)  # what `strftime_now` renders: Llama 3.1's default date_string
_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """A checkpoint's chat template (Jinja source) and the special tokens it may refer to."""
    source: str
    special_tokens: tuple[tuple[str, str], ...] = ()

    @classmethod
    def from_directory(cls, directory) -> ChatTemplate | None:
        """The template of a tokenizer directory: `chat_template.jinja`, else `tokenizer_config.json`'s
        `chat_template` (a string, or a list of {"name", "template"} whose "default" is taken); None without
        one. ValueError for a malformed `tokenizer_config.json`."""
        d = pathlib.Path(directory)
        config_path = d / "tokenizer_config.json"
        try:
            config = json.loads(config_path.read_text()) if config_path.is_file() else {}
            if not isinstance(config, dict):
                raise ValueError("not a JSON object")
        except ValueError as e:
            raise ValueError(f"{config_path}: not a tokenizer's settings ({e})") from None
        source = config.get("chat_template")
        if isinstance(source, list):
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        if (d / "chat_template.jinja").is_file():
            source = (d / "chat_template.jinja").read_text()
        if not isinstance(source, str) or not source.strip():
            return None
        tokens = []
        for name in _SPECIAL_TOKENS:
            value = config.get(name)
            value = value.get("content") if isinstance(value, dict) else value
            if isinstance(value, str):
                tokens.append((name, value))
        return cls(source, tuple(tokens))

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """The template applied to `messages`, as `apply_chat_template(..., tokenize=False)`."""
        template = _compiled(self.source)
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               **dict(self.special_tokens))


_CACHE: dict[str, object] = {}


def check_jinja() -> None:
    """ImportError (one line, how to install it) without Jinja2."""
    try:
        import jinja2  # noqa: F401
    except ImportError:
        raise ImportError("the checkpoint has a chat template, which needs Jinja2: pip install 'jaxdp[chat]' "
                          "(or pip install jinja2)") from None


def _compiled(source: str):
    if source not in _CACHE:
        check_jinja()
        from jinja2 import exceptions, ext, nodes, sandbox

        def raise_exception(message):
            raise exceptions.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                              sort_keys=sort_keys)

        class Generation(ext.Extension):  # HF's {% generation %} ... {% endgeneration %}: rendered as is
            tags = {"generation"}

            def parse(self, parser):
                lineno = next(parser.stream).lineno
                body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
                return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

            def _body(self, caller):
                return caller()

        env = sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                    extensions=[ext.loopcontrols, Generation])
        env.filters["tojson"] = tojson
        env.globals.update(raise_exception=raise_exception, strftime_now=_FIXED_NOW.strftime)
        try:
            _CACHE[source] = env.from_string(source)
        except exceptions.TemplateError as e:
            raise ValueError(f"the chat template is not valid Jinja ({type(e).__name__}: {e})") from None
    return _CACHE[source]


def segments(record: dict, template: ChatTemplate | None) -> list[tuple[object, bool]]:
    """[(text or `EOT`, counted)] of a checked record (`check_record`), in order."""
    if "messages" not in record:
        return [(record["prompt"], False), (record["completion"], True), (EOT, True)]
    messages = [{"role": m["role"], "content": m["content"]} for m in record["messages"]]
    if template is None:
        out = []
        for m in messages:
            if m["role"] == "assistant":
                out += [(PLAIN_HEADERS["assistant"], False), (m["content"], True), (EOT, True),
                        (PLAIN_TURN_END, False)]
            else:
                out.append((PLAIN_HEADERS[m["role"]] + m["content"] + PLAIN_TURN_END, False))
        return out
    return _templated(messages, template)


def _templated(messages: list[dict], template: ChatTemplate) -> list[tuple[object, bool]]:
    try:
        whole = template.render(messages)
        out, done = [], 0
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            start = template.render(messages[:i], add_generation_prompt=True)
            end = template.render(messages[:i + 1])
            if not (end.startswith(start) and whole.startswith(end) and len(start) >= done):
                raise ValueError(f"the chat template does not render this conversation prefix by prefix (turns "
                                 f"[0, {i}] are not the start of the whole), so its assistant tokens cannot be told "
                                 "apart; use prompt / completion records or a template that does")
            out += [(whole[done:len(start)], False), (whole[len(start):len(end)], True)]
            done = len(end)
    except (ImportError, ValueError):
        raise
    except Exception as e:  # a template's raise_exception, or an error inside its Jinja
        raise ValueError(f"the chat template fails on this record ({type(e).__name__}: {e})") from None
    return out + [(whole[done:], False)]


def check_record(obj) -> dict:
    """`obj` if it is a well-formed record (see the module doc); else ValueError naming what is wrong, never
    quoting the record's text."""
    if not isinstance(obj, dict):
        raise ValueError("expected a JSON object with 'prompt' and 'completion', or 'messages'")
    has_messages, has_pair = "messages" in obj, ("prompt" in obj or "completion" in obj)
    if has_messages == has_pair:
        raise ValueError("a record holds either 'prompt' and 'completion' or 'messages', " +
                         ("not both" if has_messages else "found neither"))
    if has_pair:
        for field in ("prompt", "completion"):
            if not isinstance(obj.get(field), str):
                raise ValueError(f"field {field!r} must be a string, got " +
                                 ("nothing (missing)" if field not in obj else type(obj[field]).__name__))
        if not obj["completion"].strip():
            raise ValueError("field 'completion' is empty: nothing for the loss to count")
        return obj
    messages = obj["messages"]
    if not isinstance(messages, list) or not messages:
        raise ValueError("field 'messages' must be a non-empty list of {'role', 'content'} objects")
    for j, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
            raise ValueError(f"messages[{j}] must be an object with a string 'content'")
        if m.get("role") not in ROLES:
            raise ValueError(f"messages[{j}]: role must be one of {ROLES}, got {m.get('role')!r}")
        if m["role"] == "assistant" and not m["content"].strip():
            raise ValueError(f"messages[{j}]: an assistant turn is empty: nothing for the loss to count")
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError("'messages' has no assistant turn: nothing for the loss to count")
    return obj
