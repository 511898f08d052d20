import json
from pathlib import Path

import jinja2.exceptions
import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import processors

from pdserve.models.tiny import (
    BOS_TOKEN_ID,
    END_TOKEN_ID,
    EOS_TOKEN_ID,
    SPECIAL_TOKENS,
    build_tiny_tokenizer,
    ensure_tiny_checkpoint,
)
from pdserve.models.tokenizer import Tokenizer

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi 世界"},
    {"role": "assistant", "content": "Hello 👋"},
    {"role": "user", "content": "Bye"},
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_checkpoint(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def tok(tiny_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_dir)


def make_dir(path: Path, tokenizer_config: dict | None = None, generation_config: dict | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.json").write_text(build_tiny_tokenizer().to_str())
    if tokenizer_config is not None:
        (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    if generation_config is not None:
        (path / "generation_config.json").write_text(json.dumps(generation_config))
    return path


@settings(max_examples=300, deadline=None)
@given(text=st.text())
def test_round_trip_arbitrary_text(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids, skip_special_tokens=False) == text


@pytest.mark.parametrize(
    "text", ["", "hello world", "héllo wörld", "日本語のテキスト", "emoji 😀👍🏽🇯🇵", "\x00\t\n\r ", "a\u0301"]
)
def test_round_trip_examples(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert len(ids) == len(text.encode("utf-8"))


def test_special_tokens_are_single_ids_and_skipped(tok: Tokenizer) -> None:
    ids = tok.encode("<|user|>hi<|end|>", add_special_tokens=False)
    assert ids == [258, ord("h"), ord("i"), END_TOKEN_ID]
    assert tok.decode(ids) == "hi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|user|>hi<|end|>"
    assert tok.special_token_ids == frozenset(range(256, 256 + len(SPECIAL_TOKENS)))


def test_bos_added_once(tok: Tokenizer) -> None:
    assert tok.bos_token_id == BOS_TOKEN_ID
    assert tok.encode("hi") == [BOS_TOKEN_ID, ord("h"), ord("i")]
    assert tok.encode("<s>hi") == [BOS_TOKEN_ID, ord("h"), ord("i")]
    assert tok.encode("") == [BOS_TOKEN_ID]
    assert tok.encode("hi", add_special_tokens=False) == [ord("h"), ord("i")]


def test_bos_not_doubled_when_post_processor_adds_it(tmp_path: Path) -> None:
    backend = build_tiny_tokenizer()
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", BOS_TOKEN_ID)]
    )
    make_dir(tmp_path, {"bos_token": "<s>", "add_bos_token": True})
    (tmp_path / "tokenizer.json").write_text(backend.to_str())
    assert Tokenizer.from_dir(tmp_path).encode("a") == [BOS_TOKEN_ID, ord("a")]


def test_no_bos_without_add_bos_token(tmp_path: Path) -> None:
    tok = Tokenizer.from_dir(make_dir(tmp_path, {"bos_token": "<s>"}))
    assert tok.bos_token_id == BOS_TOKEN_ID
    assert tok.encode("a") == [ord("a")]


def test_eos_ids_union_of_configs(tok: Tokenizer) -> None:
    assert tok.eos_token_ids == frozenset({EOS_TOKEN_ID, END_TOKEN_ID})
    assert tok.eos_token == "</s>"


@pytest.mark.parametrize(
    ("tokenizer_config", "generation_config", "eos_ids", "bos_id"),
    [
        (
            {"eos_token": {"content": "</s>", "special": True}},
            {"eos_token_id": END_TOKEN_ID},
            {257, 261},
            None,
        ),
        ({"eos_token": "<|end|>", "bos_token": {"content": "<s>"}}, None, {261}, 256),
        (None, {"eos_token_id": [257, 260], "bos_token_id": 256}, {257, 260}, 256),
        (None, None, set(), None),
    ],
)
def test_special_tokens_from_configs(
    tmp_path: Path,
    tokenizer_config: dict | None,
    generation_config: dict | None,
    eos_ids: set,
    bos_id: int | None,
) -> None:
    tok = Tokenizer.from_dir(make_dir(tmp_path, tokenizer_config, generation_config))
    assert tok.eos_token_ids == frozenset(eos_ids)
    assert tok.bos_token_id == bos_id


def test_decode_skips_ids_outside_vocab(tok: Tokenizer) -> None:
    assert tok.vocab_size == 256 + len(SPECIAL_TOKENS)
    assert tok.decode([ord("h"), 300, 383, -1, 2**40, ord("i")]) == "hi"
    assert tok.convert_ids_to_tokens([ord("h"), BOS_TOKEN_ID, 300, -5]) == ["h", "<s>", None, None]
    assert tok.id_to_token(ord(" ")) == "Ġ"
    assert tok.token_to_id("</s>") == EOS_TOKEN_ID


def test_tiny_chat_template(tok: Tokenizer) -> None:
    prompt = tok.apply_chat_template(CHAT)
    assert prompt == (
        "<s><|system|>\nBe brief.<|end|>\n<|user|>\nHi 世界<|end|>\n"
        "<|assistant|>\nHello 👋<|end|>\n<|user|>\nBye<|end|>\n<|assistant|>\n"
    )
    assert tok.apply_chat_template(CHAT, add_generation_prompt=False) == prompt.removesuffix(
        "<|assistant|>\n"
    )
    ids = tok.encode(prompt, add_special_tokens=False)
    assert ids[:2] == [BOS_TOKEN_ID, 260] and ids[-2:] == [259, ord("\n")]


def test_chat_template_raise_exception(tok: Tokenizer) -> None:
    with pytest.raises(ValueError, match="unknown role: tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


def test_missing_chat_template_is_clear_error(tmp_path: Path) -> None:
    tok = Tokenizer.from_dir(make_dir(tmp_path))
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template(CHAT)


def test_chat_template_list_picks_default_and_jinja_file(tmp_path: Path) -> None:
    templates = [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": "DEFAULT"}]
    tok = Tokenizer.from_dir(make_dir(tmp_path / "a", {"chat_template": templates}))
    assert tok.apply_chat_template(CHAT) == "DEFAULT"
    b = make_dir(tmp_path / "b", {})
    (b / "chat_template.jinja").write_text("{{ messages | length }}")
    assert Tokenizer.from_dir(b).apply_chat_template(CHAT) == "4"


def test_chat_template_whitespace_control_and_tojson(tmp_path: Path) -> None:
    template = (
        "{% for m in messages %}\n"
        "    {% if loop.index > 2 %}{% break %}{% endif %}\n"
        "{{ m | tojson }}\n"
        "{% endfor %}\n"
        "{% if add_generation_prompt %}[{{ eos_token }}]{% endif %}"
    )
    tok = Tokenizer.from_dir(make_dir(tmp_path, {"chat_template": template, "eos_token": "</s>"}))
    assert tok.apply_chat_template(CHAT) == (
        '{"role": "system", "content": "Be brief."}\n{"role": "user", "content": "Hi 世界"}\n[</s>]'
    )


def test_chat_template_matches_transformers(tiny_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(str(tiny_dir))
    ours = Tokenizer.from_dir(tiny_dir)
    for add_generation_prompt in (True, False):
        expected = hf.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=add_generation_prompt)
        assert ours.apply_chat_template(CHAT, add_generation_prompt=add_generation_prompt) == expected
    text = "mixed 世界 😀 text"
    assert ours.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)


def test_chat_template_is_sandboxed(tmp_path: Path) -> None:
    tok = Tokenizer.from_dir(make_dir(tmp_path, {"chat_template": "{{ messages.append(1) }}"}))
    with pytest.raises(jinja2.exceptions.SecurityError):
        tok.apply_chat_template(CHAT)
    assert len(CHAT) == 4


def test_wraps_backend_directly() -> None:
    tok = Tokenizer(build_tiny_tokenizer(), eos_token_ids=[EOS_TOKEN_ID], bos_token_id=BOS_TOKEN_ID)
    assert tok.bos_token == "<s>" and tok.eos_token == "</s>"
    assert isinstance(tok.backend, tokenizers.Tokenizer)
    assert tok.encode("a") == [ord("a")]
