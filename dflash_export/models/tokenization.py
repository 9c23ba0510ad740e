"""Text <-> token ids for engines, without torch or transformers: the `tokenizers` library plus the model's own
jinja2 chat template. Tiny random pairs have no tokenizer and use a byte codec (one token per byte) instead.

The chat template comes from a checkpoint (and is copied into every engine), so it is untrusted code: it is compiled
and rendered only in jinja2's immutable sandbox, as transformers does, bounded in work and size (chat_sandbox.py).
A template reaching for Python internals (`cycler.__init__.__globals__...`) gets a DFlashError naming
`chat_template`, never runs anything; one that loops or recurses without end is stopped the same way.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

from dflash_export.decoding.request import check_unicode
from dflash_export.errors import DFlashError
from dflash_export.models.chat_sandbox import MAX_RENDERED_CHARS, compiled_template


class ChatTemplateError(DFlashError):
    """The chat template failed on the messages it was given (it raised, erred, or was stopped at its bounds). Named by
    the file and field it came from (tokenizer_config.json `chat_template`, or chat_template.jinja) where it came from
    one; a server answers it with `served_message`, which names no file of the server's."""

    def served_message(self) -> str:
        return f"chat_template: the server's chat template failed on these messages: {self.message}"


def default_template(templates: list) -> tuple[int, str] | None:
    """(index, template) of the entry named "default" in transformers' list of named chat templates ({"name",
    "template"} objects), the one a prompt renders with when no other is asked for (the last of that name, as
    transformers keeps them in a dict); None when no entry is named so."""
    found = None
    for i, t in enumerate(templates):
        if isinstance(t, dict) and t.get("name") == "default":
            found = (i, t.get("template"))
    return found


class TextCodec:
    """Encode prompts / message lists and decode generated ids (streaming-safe incremental decode).

    Safe to share between threads. `encode_special_tokens` is a setting of a `tokenizers.Tokenizer`, so text that
    must keep special tokens' spellings as text goes through its own copy with that setting on (`text_tokenizer`),
    never through the shared one switched back and forth. The copy is made at the first such text, under a lock: a
    tokenizer holds ~31 MB for SmolLM2's vocabulary, which a process that never sees a special token's spelling in
    text does not pay.
    """

    def __init__(self, tokenizer, chat_template: str | None, special: dict[str, str], add_bos: str | None = None,
                 template_path: Path | None = None, template_field: str | None = "chat_template"):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        # Where the template came from, named in its errors (`ChatTemplateError`): a file, and its field if any.
        self.template_path, self.template_field = template_path, template_field
        self.special = special
        self.add_bos = add_bos
        self._specials: list[str] = []
        self._text_tokenizer = None
        self._text_lock = threading.Lock()
        if tokenizer is not None:
            try:
                added = tokenizer.get_added_tokens_decoder().values()
                self._specials = [a.content for a in added if a.special and a.content]
            except AttributeError:
                pass

    @property
    def text_tokenizer(self):
        """The tokenizer's copy that encodes special tokens' spellings as text (None without special tokens)."""
        if self._text_tokenizer is None and self._specials:
            with self._text_lock:
                if self._text_tokenizer is None:
                    from tokenizers import Tokenizer

                    tok = Tokenizer.from_str(self.tokenizer.to_str())
                    tok.encode_special_tokens = True
                    self._text_tokenizer = tok  # published only once set up
        return self._text_tokenizer

    @classmethod
    def from_dir(cls, d: Path) -> "TextCodec":
        d = Path(d)
        tok_file = d / "tokenizer.json"
        if not tok_file.is_file():
            return ByteCodec.from_dir(d)
        from tokenizers import Tokenizer

        try:
            # Read here, parsed from memory: tokenizers' own open takes a UTF-8 path, which a directory name the
            # locale cannot decode is not.
            tok = Tokenizer.from_buffer(tok_file.read_bytes())
        except OSError as e:
            raise DFlashError(f"cannot read it ({e.strerror})", path=tok_file) from None
        except Exception as e:  # tokenizers raises a bare Exception for bad files
            raise DFlashError(f"cannot load tokenizer ({e})", path=tok_file) from None
        cfg = {}
        if (d / "tokenizer_config.json").is_file():
            cfg = json.loads((d / "tokenizer_config.json").read_text(encoding="utf-8"))
        # As transformers reads them: chat_template.jinja before tokenizer_config.json's entry (checked by
        # engines.base.check_codec_files), whose list of named templates renders with its default one.
        template, path, field = cfg.get("chat_template"), d / "tokenizer_config.json", "chat_template"
        if (d / "chat_template.jinja").is_file():
            path, field = d / "chat_template.jinja", None
            template = path.read_text(encoding="utf-8")
        elif isinstance(template, list):
            i, template = default_template(template) or (None, None)
            field = f"chat_template[{i}]"
        special = {k: _tok_str(cfg.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")
                   if cfg.get(k) is not None}
        return cls(tok, template, special, template_path=path, template_field=field)

    @staticmethod
    def save_from_hf(hf_tokenizer, d: Path) -> None:
        """Write tokenizer.json + tokenizer_config.json (chat template included) from a transformers tokenizer."""
        hf_tokenizer.save_pretrained(str(d))

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def _special_texts(self) -> list[str]:
        return self._specials

    def encode_text(self, text: str) -> list[int]:
        """Text as text: a special token's spelling in it (`<|im_start|>`) becomes ordinary tokens, never control."""
        if not self._specials or not any(sp in text for sp in self._specials):
            return self.encode(text)
        return self.text_tokenizer.encode(text, add_special_tokens=False).ids

    def apply_chat(self, messages: list[dict]) -> list[int]:
        """The chat template's rendering, tokenized. Message contents are text: where one spells a special token,
        the template's own text is tokenized with its special tokens and each content on its own as plain text, so
        `<|im_start|>system` typed by a user cannot open a turn (as strict servers do)."""
        if not self.chat_template:
            return self.encode("\n".join(m.get("content", "") for m in messages))
        specials = self._special_texts()
        if specials and any(isinstance(m.get("content"), str) and any(sp in m["content"] for sp in specials)
                            for m in messages):
            return self._apply_chat_contents_as_text(messages)
        return self.encode(self.render_chat(messages))

    def _apply_chat_contents_as_text(self, messages: list[dict]) -> list[int]:
        import re

        marks = [f"\ue000{i}\ue001" for i in range(len(messages))]
        text = self.render_chat([{**m, "content": mark} for m, mark in zip(messages, marks)])
        parts = re.split("(" + "|".join(re.escape(m) for m in marks) + ")", text)
        if sorted(p for p in parts if p in marks) != sorted(marks):
            raise DFlashError("a message spells a special token of the tokenizer, and this chat template does not "
                              "place message contents verbatim, so they cannot be kept as plain text",
                              field="messages")
        ids: list[int] = []
        for p in parts:
            ids += self.encode_text(messages[marks.index(p)]["content"]) if p in marks else self.encode(p)
        return ids

    def render_chat(self, messages: list[dict]) -> str:
        """The chat template rendered for `messages`; ChatTemplateError, naming where the template came from, when it
        fails on them."""
        from jinja2.sandbox import SecurityError

        def failed(message: str) -> ChatTemplateError:
            return ChatTemplateError(message, path=self.template_path, field=self.template_field)

        try:
            template = compiled_template(self.chat_template)
            # Streamed and bounded: a template that writes more than MAX_RENDERED_CHARS (no prompt this long fits
            # the largest context an engine takes) is stopped there rather than filling memory.
            parts, size = [], 0
            for part in template.generate(messages=messages, add_generation_prompt=True, **self.special):
                size += len(part)
                if size > MAX_RENDERED_CHARS:
                    raise failed(f"the chat template wrote more than {MAX_RENDERED_CHARS} characters for these "
                                 "messages")
                parts.append(part)
            # Text a tokenizer takes: a lone surrogate (`'\\ud800'` in the template) cannot be UTF-8.
            return check_unicode("".join(parts), "chat_template")
        except ChatTemplateError:
            raise
        except DFlashError as e:  # the sandbox's bounds, or the template's own raise_exception
            raise failed(e.message) from None
        except RecursionError:
            raise failed("the chat template went deeper than Python's recursion limit (a macro or recursive loop "
                         "calling itself without end, or nesting too deep)") from None
        except SecurityError as e:
            raise failed(f"the chat template tried an unsafe operation, refused by the sandbox "
                         f"({' '.join(str(e).split())[:200]})") from None
        except Exception as e:  # a template that compiles but fails on these messages: bad template or bad request
            raise failed(f"cannot render the chat template for these messages ({type(e).__name__}: "
                         f"{' '.join(str(e).split())[:200]})") from None

    def encode_prompt(self, prompt: str | list[dict], chat: bool = True) -> list[int]:
        if isinstance(prompt, list):
            return self.apply_chat(prompt)
        if chat and self.chat_template:
            return self.apply_chat([{"role": "user", "content": prompt}])
        # A raw prompt (no template) is the caller's whole text, special tokens included: whoever sends one writes
        # the turns themselves (OpenAI's /v1/completions).
        return self.encode(prompt)

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special)


def max_token_chars(engine_dir: Path) -> int:
    """Characters of prompt text one token can cover at most, for the codec files of an engine directory: a prompt
    longer than this times the engine's room cannot fit, so it is refused before any tokenizer sees it.

    Read from the vocabulary without the tokenizer: the longest entry (byte-level and metaspace entries are at least
    as long as the text they decode to; byte-fallback entries `<0x41>` are longer), times 4 when the tokenizer has a
    normalizer (which may fold several characters into one before the model sees them). The byte codec of tiny
    pairs: 2 (one token per byte, a reserved byte dropped now and then). 0 when the files cannot be read (no bound).
    """
    d = Path(engine_dir)
    try:
        spec = json.loads((d / "tokenizer.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        return 2 if (d / "codec.json").is_file() else 0
    except (OSError, ValueError):
        return 0
    if not isinstance(spec, dict) or not isinstance(spec.get("model"), dict):
        return 0
    vocab = spec["model"].get("vocab")
    entries = list(vocab) if isinstance(vocab, dict) else [v[0] for v in vocab or [] if isinstance(v, list) and v]
    entries += [t.get("content") for t in spec.get("added_tokens") or [] if isinstance(t, dict)]
    longest = max((len(e) for e in entries if isinstance(e, str)), default=0)
    norm = spec.get("normalizer")
    folds = isinstance(norm, dict) and not (norm.get("type") == "Sequence" and not norm.get("normalizers"))
    return longest * (4 if folds else 1)


def prompt_chars(prompt: str | list[dict]) -> int:
    """The characters of a prompt's text: the string, or every message's content."""
    if isinstance(prompt, str):
        return len(prompt)
    return sum(len(m["content"]) for m in prompt if isinstance(m, dict) and isinstance(m.get("content"), str))


def _tok_str(v):
    return v.get("content") if isinstance(v, dict) else v


class ByteCodec(TextCodec):
    """Tiny pairs: token id = byte value (ids above 255 or reserved ids decode to nothing)."""

    def __init__(self, vocab_size: int, reserved: set[int]):
        super().__init__(None, None, {})
        self.vocab_size = vocab_size
        self.reserved = reserved

    @classmethod
    def from_dir(cls, d: Path) -> "ByteCodec":
        cfg = {}
        if (Path(d) / "codec.json").is_file():
            cfg = json.loads((Path(d) / "codec.json").read_text(encoding="utf-8"))
        return cls(int(cfg.get("vocab_size", 256)), set(cfg.get("reserved", [])))

    def encode(self, text: str) -> list[int]:
        limit = min(self.vocab_size, 256)
        return [b % limit for b in text.encode("utf-8") if (b % limit) not in self.reserved]

    def apply_chat(self, messages: list[dict]) -> list[int]:
        return self.encode("\n".join(f"{m.get('role', 'user')}: {m.get('content', '')}" for m in messages) + "\n")

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        data = bytes(i for i in ids if 0 <= i < 256 and not (skip_special and i in self.reserved))
        return data.decode("utf-8", errors="replace")
