"""A checkpoint's chat template, rendered as transformers renders it (`apply_chat_template`).

The template is `chat_template.jinja` (where transformers 5 writes it) or `chat_template` in
`tokenizer_config.json` (older checkpoints; a list of named templates takes the one named `default`), in the
tokenizer's directory (a run's copy, `jaxlong.data.imported`). It is Jinja, rendered in a sandbox with the
environment transformers uses: `trim_blocks`, `lstrip_blocks`, loop controls, the `{% generation %}` tag (its
body rendered as is), `raise_exception`, `strftime_now` and a `tojson` that does not escape HTML; the special
tokens of the tokenizer's config files (`bos_token`, `eos_token`, ...) are template variables. The rendered text
is tokenized without the tokenizer's post-processor (the template places the special tokens), as transformers does.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path

from jaxlong.data.tokenizer import special_tokens

__all__ = ["ChatTemplate", "find_template", "run_template"]

GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
RUN_TEMPLATE = "chat_template.jinja"  # RUN_DIR/chat_template.jinja: a run's copy of data.chat_template
MARK_OPEN, MARK_CLOSE = "\ue000", "\ue001"  # private-use characters around a {% generation %} body (mark_generation)
SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


def find_template(directory: str | Path) -> str | None:
    """The chat template of the tokenizer directory `directory`, or None when it has none."""
    f, config = Path(directory) / "chat_template.jinja", Path(directory) / "tokenizer_config.json"
    if f.is_file():
        return f.read_text(encoding="utf-8")
    template = json.loads(config.read_text(encoding="utf-8")).get("chat_template") if config.is_file() else None
    if isinstance(template, list):  # named templates
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    return template if isinstance(template, str) else None


class ChatTemplate:
    """The chat template of a tokenizer directory.

    Args:
      directory: the tokenizer's directory (`chat_template.jinja`, `tokenizer_config.json`,
        `special_tokens_map.json`).
      template_file: a Jinja file to use instead of the directory's template (`data.chat_template`, for a
        checkpoint without one); the special tokens still come from `directory`.
      mark_generation: `render_spans` reports the `{% generation %}` bodies (`marks_generation` is True when the
        template has such tags).

    Raises:
      ValueError: no chat template (the message names where one is looked for), or one that is not valid Jinja.
    """

    def __init__(self, directory: str | Path, template_file: str | Path | None = None, mark_generation: bool = False):
        import jinja2  # noqa: PLC0415 (only chat needs it)
        from jinja2.ext import Extension, loopcontrols  # noqa: PLC0415
        from jinja2.sandbox import ImmutableSandboxedEnvironment  # noqa: PLC0415

        self.directory = Path(directory)
        if template_file is not None:
            if not Path(template_file).is_file():
                raise ValueError(f"data.chat_template={str(template_file)!r}: no such file; give a Jinja chat template "
                                 f"file (as transformers writes chat_template.jinja)")
            source = Path(template_file).read_text(encoding="utf-8")
        else:
            source = find_template(self.directory)
        if source is None:
            raise ValueError(f"{self.directory} has no chat template (chat_template.jinja, or chat_template in "
                             f"tokenizer_config.json): --chat needs an instruct checkpoint's template; drop --chat "
                             f"to continue plain text")

        class Generation(Extension):  # `{% generation %}...{% endgeneration %}`: the body, as rendered
            tags = {"generation"}

            def parse(self, parser):
                lineno = next(parser.stream).lineno
                body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
                return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

            def _body(self, caller):
                return MARK_OPEN + caller() + MARK_CLOSE if mark else caller()

        self.marks_generation = mark = mark_generation and GENERATION_TAG.search(source) is not None

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[Generation, loopcontrols])
        env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: \
            json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
        env.globals.update(raise_exception=raise_exception, strftime_now=lambda f: datetime.now().strftime(f))
        self.where = str(template_file) if template_file is not None else str(self.directory)
        try:
            self.template = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"{self.where}: the chat template is not valid Jinja (line {e.lineno}: {e})") from None
        self.special = special_tokens(self.directory, SPECIAL_KEYS)

    def _render(self, messages: list[dict], add_generation_prompt: bool, kwargs: dict) -> str:
        import jinja2  # noqa: PLC0415

        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        **{**self.special, **kwargs})
        except jinja2.TemplateError as e:
            raise ValueError(f"{self.where}: the chat template refused the messages: {e}") from None

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """The template's text for `messages` (`[{"role": ..., "content": ...}, ...]`), with the assistant turn's
        opening when `add_generation_prompt`; `kwargs` are further template variables (e.g. `tools`).

        Raises:
          ValueError: the template raised (e.g. `raise_exception('roles must alternate')`).
        """
        text = self._render(messages, add_generation_prompt, kwargs)
        return text.replace(MARK_OPEN, "").replace(MARK_CLOSE, "") if self.marks_generation else text

    def render_spans(self, messages: list[dict], **kwargs) -> tuple[str, list[tuple[int, int]]]:
        """The template's text for `messages` (no generation prompt) and the `[start, end)` character spans of its
        `{% generation %}` bodies, in order (empty unless `marks_generation`)."""
        if any(MARK_OPEN in str(m.get("content")) or MARK_CLOSE in str(m.get("content")) for m in messages):
            raise ValueError("a message contains U+E000 or U+E001, the private-use characters that mark "
                             "{% generation %} spans; remove them from the data")
        marked = self._render(messages, False, kwargs)
        text, spans, start = [], [], None
        for piece in re.split(f"([{MARK_OPEN}{MARK_CLOSE}])", marked):
            if piece == MARK_OPEN:
                start = sum(map(len, text))
            elif piece == MARK_CLOSE:
                spans.append((start, sum(map(len, text))))
            else:
                text.append(piece)
        return "".join(text), spans


def run_template(template_file: str | Path | None, directory: str | Path | None,
                 mark_generation: bool = False, run_dir: str | Path | None = None) -> ChatTemplate | None:
    """The chat template a run renders with, for training on chat data, `python -m jaxlong.generate --chat` and
    `python -m jaxlong.eval --chat` alike: `data.chat_template` (`template_file`) when set (for a trained run,
    `run_dir`, its copy `RUN_DIR/chat_template.jinja`: `jaxlong.data.imported.keep_chat_template`), else the
    template of the tokenizer's directory (`directory`, the run's copy: `jaxlong.data.tokenizer_source`; None for
    the byte tokenizer); None when there is neither.

    Raises:
      ValueError: `template_file` missing or not valid Jinja, or the directory's template not valid Jinja.
    """
    if template_file is not None and run_dir is not None and (Path(run_dir) / RUN_TEMPLATE).is_file():
        template_file = Path(run_dir) / RUN_TEMPLATE  # what the run trained with
    if template_file is not None:
        return ChatTemplate(directory or Path(template_file).parent, template_file, mark_generation)
    if directory is None or find_template(directory) is None:
        return None
    return ChatTemplate(directory, mark_generation=mark_generation)
