"""Tokenizer of a Hugging Face model directory: `tokenizers` model, special tokens, chat template."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment


class Tokenizer:
    """A `tokenizers.Tokenizer` plus what the model directory says about BOS, EOS and chat.

    BOS policy: `add_bos_token` (from tokenizer_config.json, default False) prepends the BOS id on
    `encode(add_special_tokens=True)` unless the tokenizer's own post-processor already put it first.
    A missing key means the post-processor in tokenizer.json is the single source of truth, which is
    how Hugging Face fast tokenizers behave for Llama-3, Qwen2 and Mistral directories.
    Chat prompts already carry `bos_token` from the template: encode them with add_special_tokens=False.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        bos_token_id: int | None = None,
        eos_token_ids: Iterable[int] = (),
        add_bos_token: bool = False,
    ) -> None:
        self.backend = backend
        self.chat_template = chat_template
        if bos_token is None and bos_token_id is not None:
            bos_token = backend.id_to_token(bos_token_id)
        self.bos_token = bos_token
        self.bos_token_id = backend.token_to_id(bos_token) if bos_token is not None else None
        eos_ids = set(eos_token_ids)
        if eos_token is not None and (eos_id := backend.token_to_id(eos_token)) is not None:
            eos_ids.add(eos_id)
        if eos_token is None and eos_ids:
            eos_token = backend.id_to_token(min(eos_ids))
        self.eos_token = eos_token
        self.eos_token_ids: frozenset[int] = frozenset(eos_ids)
        self.add_bos_token = add_bos_token and self.bos_token_id is not None
        self.special_token_ids: frozenset[int] = frozenset(
            i for i, token in backend.get_added_tokens_decoder().items() if token.special
        )
        self._id_limit = max(backend.get_vocab(with_added_tokens=True).values(), default=-1) + 1
        self._compiled_template: jinja2.Template | None = None

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        backend = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
        config = _read_json(path / "tokenizer_config.json")
        generation = _read_json(path / "generation_config.json")
        chat_template = _pick_chat_template(config.get("chat_template"))
        template_file = path / "chat_template.jinja"
        if chat_template is None and template_file.is_file():
            chat_template = template_file.read_text(encoding="utf-8")
        eos_ids = generation.get("eos_token_id")
        if isinstance(eos_ids, int):
            eos_ids = [eos_ids]
        return cls(
            backend,
            chat_template=chat_template,
            bos_token=_token_content(config.get("bos_token")),
            eos_token=_token_content(config.get("eos_token")),
            bos_token_id=generation.get("bos_token_id"),
            eos_token_ids=eos_ids or (),
            add_bos_token=bool(config.get("add_bos_token", False)),
        )

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos_token and (not ids or ids[0] != self.bos_token_id):
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        # A model's vocab may be padded beyond the tokenizer's: ids it cannot name are dropped.
        known = [i for i in ids if 0 <= i < self._id_limit]
        return self.backend.decode(known, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        if not 0 <= token_id < self._id_limit:
            return None
        return self.backend.id_to_token(token_id)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]:
        return [self.id_to_token(i) for i in ids]

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        return self._template().render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **extra,
        )

    def _template(self) -> jinja2.Template:
        if self._compiled_template is None:
            if not self.chat_template:
                raise ValueError(
                    "this model has no chat template (tokenizer_config.json has no 'chat_template' and "
                    "there is no chat_template.jinja); send a plain completion prompt instead"
                )
            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
            )
            env.globals["raise_exception"] = _raise_exception
            env.filters["tojson"] = _tojson
            self._compiled_template = env.from_string(self.chat_template)
        return self._compiled_template


def _raise_exception(message: str) -> None:
    raise ValueError(f"chat template: {message}")


def _tojson(value: Any, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    return json.loads(path.read_text(encoding="utf-8"))


def _token_content(token: str | dict[str, Any] | None) -> str | None:
    if isinstance(token, dict):
        return token.get("content")
    return token


def _pick_chat_template(template: str | list[dict[str, str]] | None) -> str | None:
    if isinstance(template, list):
        named = {entry.get("name"): entry.get("template") for entry in template}
        return named.get("default")
    return template
