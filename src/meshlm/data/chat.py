"""Chat and instruction data: records rendered with the tokenizer's own chat template, and which of
their tokens are trained.

Formats (`meshlm data prepare --format`):
    chat        a record's `messages` ([{"role", "content"}, ...]) rendered by the chat template
    completion  a record's `prompt` and `completion`, joined as they are (no template)

The template is the tokenizer's: `chat_template.jinja` beside its tokenizer.json (as `transformers`
saves it now), else tokenizer_config.json's `chat_template`, else `--chat-template FILE`. It runs
in Jinja2's immutable sandbox with the helpers `transformers` gives templates (`raise_exception`,
`strftime_now`, a `tojson` that keeps non-ASCII, `{% generation %}` blocks rendered as their body),
and the tokenizer's special tokens (`bos_token`, `eos_token`, ...) from tokenizer_config.json.

Which characters are trained (`train_on`), found for any template, with or without
`{% generation %}` markers, by rendering the conversation's prefixes:
    assistant   every assistant message: the characters between the render of the messages before
                it with the generation prompt and the render up to and including it (its content
                and whatever the template closes the turn with)
    last        the last assistant message only
    completion  the completion (format completion)
    all         everything
A template whose render of a prefix is not a prefix of the whole (one that rewrites earlier turns,
as some reasoning templates drop past thinking) cannot be cut this way: such a conversation is a
bad record (`--on-error skip` counts it). A token is trained when its characters overlap a trained
span (the rule `transformers` uses for `return_assistant_tokens_mask`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from meshlm.config import ConfigError

TRAIN_ON = {"chat": ("assistant", "last", "all"), "completion": ("completion", "all")}
DEFAULT_FIELD = {"chat": "messages", "completion": "prompt"}


class ChatError(ValueError):
    """A record this format or template cannot render (counted as `bad_record` when skipping)."""


@dataclass(frozen=True)
class Format:
    """How records become tokens: `kind` (text | chat | completion), the mask rule, the template and
    the special tokens it is given. Picklable: it travels to the processes that encode units."""

    kind: str = "text"
    train_on: str = ""
    template: str = ""
    special: tuple[tuple[str, str], ...] = ()

    @property
    def packed(self) -> bool:
        return self.kind != "text"

    def key(self) -> str:
        """What decides the bytes besides the tokenizer (a work unit's key, the index)."""
        if not self.packed:
            return "text"
        blob = json.dumps([self.kind, self.train_on, self.template, self.special])
        return hashlib.blake2b(blob.encode(), digest_size=8).hexdigest()

    def describe(self) -> dict:
        out = {"format": self.kind, "train_on": self.train_on}
        if self.template:
            out["chat_template_sha256"] = hashlib.sha256(self.template.encode()).hexdigest()[:16]
        return out


def make_format(kind: str, train_on: str, tokenizer_path: str | Path | None, template_file: str = "") -> Format:
    """The Format of `meshlm data prepare --format KIND --train-on RULE` with the given tokenizer."""
    if kind == "text":
        return Format()
    if kind not in TRAIN_ON:
        raise ConfigError(f"--format {kind!r}: one of text, chat, completion")
    train_on = train_on or TRAIN_ON[kind][0]
    if train_on not in TRAIN_ON[kind]:
        raise ConfigError(f"--train-on {train_on!r} with --format {kind}: one of {', '.join(TRAIN_ON[kind])}")
    if kind == "completion":
        return Format(kind, train_on)
    if not tokenizer_path:
        raise ConfigError("--format chat needs --tokenizer (its directory holds the chat template)")
    template, special = find_template(Path(tokenizer_path), template_file)
    fmt = Format(kind, train_on, template, special)
    Renderer.of(fmt)  # a template that does not compile fails here, named, before any work
    return fmt


def find_template(tokenizer_path: Path, template_file: str = "") -> tuple[str, tuple[tuple[str, str], ...]]:
    """(template, special tokens) for a tokenizer.json: `template_file`, else chat_template.jinja
    beside it, else tokenizer_config.json's chat_template (a string, or a list whose "default")."""
    root = tokenizer_path.parent
    config = {}
    if (root / "tokenizer_config.json").is_file():
        try:
            config = json.loads((root / "tokenizer_config.json").read_text(encoding="utf-8"))
        except ValueError as e:
            raise ConfigError(f"{root / 'tokenizer_config.json'} is not JSON ({e})") from None
    special = []
    for name in ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token"):
        value = config.get(name)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            special.append((name, value))
    if template_file:
        path = Path(template_file)
        if not path.is_file():
            raise ConfigError(f"--chat-template {template_file}: no such file")
        return path.read_text(encoding="utf-8"), tuple(special)
    if (root / "chat_template.jinja").is_file():
        return (root / "chat_template.jinja").read_text(encoding="utf-8"), tuple(special)
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if not isinstance(template, str) or not template:
        raise ConfigError(
            f"no chat template for {tokenizer_path}: put chat_template.jinja beside it, give tokenizer_config.json "
            "a chat_template, or pass --chat-template FILE"
        )
    return template, tuple(special)


_RENDERERS: dict[str, Renderer] = {}


class Renderer:
    """A compiled template and the spans its renders give (one per process and format)."""

    def __init__(self, fmt: Format):
        self.fmt = fmt
        self.special = dict(fmt.special)
        self.template = _compile(fmt.template) if fmt.kind == "chat" else None

    @staticmethod
    def of(fmt: Format) -> Renderer:
        key = fmt.key()
        if key not in _RENDERERS:
            _RENDERERS[key] = Renderer(fmt)
        return _RENDERERS[key]

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        import jinja2

        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt, **self.special)
        except jinja2.TemplateError as e:
            raise ChatError(f"the chat template refused it ({e})") from None

    def _prompt(self, messages: list[dict]) -> str:
        """The render of `messages` with the generation prompt; of none (a conversation that opens
        with the assistant), the template's prompt alone, or "" if it refuses an empty conversation."""
        try:
            return self.render(messages, add_generation_prompt=True)
        except ChatError:
            if messages:
                raise
            return ""

    def spans(self, record) -> tuple[str, list[tuple[int, int]], bool]:
        """(the text, its trained character spans, whether the appended end-of-text is trained)."""
        if self.fmt.kind == "completion":
            prompt, completion = record
            text = prompt + completion
            return text, [(0 if self.fmt.train_on == "all" else len(prompt), len(text))], True
        text = self.render(record)
        if self.fmt.train_on == "all":
            return text, [(0, len(text))], True
        turns = [i for i, m in enumerate(record) if m["role"] == "assistant"]
        if self.fmt.train_on == "last":
            turns = turns[-1:]
        spans = []
        for i in turns:
            before = self._prompt(record[:i])
            upto = self.render(record[: i + 1])
            if not (text.startswith(upto) and upto.startswith(before)):
                raise ChatError(
                    f"the chat template renders message {i}'s prefix differently from the whole conversation "
                    "(it rewrites earlier turns), so its assistant spans cannot be found by prefixes"
                )
            spans.append((len(before), len(upto)))
        return text, spans, False


def _compile(template: str):
    """The template in Jinja2's immutable sandbox, with the helpers `transformers` gives templates."""
    import datetime

    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}`: rendered as its body (spans come from prefixes)."""

        tags: ClassVar[set[str]] = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.TemplateError as e:
        raise ConfigError(f"the chat template does not compile: {e}") from None


def check_messages(value) -> list[dict]:
    """A record's messages, as the template gets them; ChatError if they are not [{role, content}]."""
    if not isinstance(value, list) or not value:
        raise ChatError(f"messages must be a non-empty list of {{role, content}}, got {type(value).__name__}")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ChatError(f'message {i} is not {{"role": str, "content": str}}')
        out.append({k: v for k, v in m.items() if v is not None})
    if not any(m["role"] == "assistant" for m in out):
        raise ChatError("no assistant message (nothing to train on)")
    return out


def trained_tokens(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[bool]:
    """Per token: do its characters overlap a trained span (spans and offsets in order)."""
    out = [False] * len(offsets)
    k = 0
    for t, (start, end) in enumerate(offsets):
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        out[t] = end > spans[k][0]
    return out
