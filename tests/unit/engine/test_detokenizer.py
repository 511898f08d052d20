import string
from collections.abc import Sequence
from pathlib import Path

import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

from pdserve.engine.detokenizer import MAX_HELD_TOKENS, PROMPT_CONTEXT_TOKENS, IncrementalDetokenizer
from pdserve.models.tiny import END_TOKEN_ID, EOS_TOKEN_ID, build_tiny_tokenizer, ensure_tiny_checkpoint
from pdserve.models.tokenizer import Tokenizer

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "日本語のテキストと中文的文本",
    "emoji 😀😃😄 🇯🇵 👍🏽",
    "naïve café déjà vu",
    "Ελληνικά και русский текст",
] * 20


class CountingTokenizer(Tokenizer):
    """Records how many ids each decode call sees."""

    def __init__(self, backend: tokenizers.Tokenizer) -> None:
        super().__init__(backend)
        self.decode_lengths: list[int] = []

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        self.decode_lengths.append(len(ids))
        return super().decode(ids, skip_special_tokens)


def trained_byte_level_bpe() -> tokenizers.Tokenizer:
    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|end|>"],
        show_progress=False,
    )
    backend.train_from_iterator(CORPUS, trainer)
    return backend


def sentencepiece_like_bpe() -> tokenizers.Tokenizer:
    """Llama-2 style: '▁' for spaces, byte fallback, one leading space stripped on decode."""
    vocab = {"<unk>": 0} | {f"<0x{b:02X}>": 1 + b for b in range(256)}
    for ch in "▁" + string.ascii_letters + string.digits + string.punctuation + "世界":
        vocab.setdefault(ch, len(vocab))
    merges = [("▁", "t"), ("h", "e"), ("▁t", "he"), ("▁", "a")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    backend = tokenizers.Tokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True)
    )
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    backend.add_special_tokens(["</s>"])
    return backend


TOKENIZERS = {
    "tiny": Tokenizer(build_tiny_tokenizer()),
    "bpe": Tokenizer(trained_byte_level_bpe()),
    "spm": Tokenizer(sentencepiece_like_bpe()),
}
# Special-token strings in text encode to special ids (HF semantics), which decoding skips; they are
# covered by test_special_token_text_round_trip, not by the round-trip properties below.
SPECIAL_STRINGS = ("<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>")
texts = st.text(st.characters(blacklist_categories=["Cs"], blacklist_characters="▁"), max_size=40).filter(
    lambda t: not any(s in t for s in SPECIAL_STRINGS)
)
mixed_texts = st.lists(
    st.sampled_from([*CORPUS[:5], " ", "a", "é", "世", "😀", "🇯🇵", "👍🏽", "the"]), max_size=8
).map("".join)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_dir(ensure_tiny_checkpoint(tmp_path_factory.mktemp("cache")))


def stream(det: IncrementalDetokenizer, ids: list[int], chunk_sizes: Sequence[int] = ()) -> list[str]:
    """Feeds ids in chunks (then one at a time), checking the committed-text invariants as it goes."""
    deltas, pos = [], 0
    sizes = list(chunk_sizes) + [1] * len(ids)
    while pos < len(ids):
        deltas.append(det.add_tokens(ids[pos : pos + sizes[len(deltas)]]))
        pos += sizes[len(deltas) - 1]
        assert det.output_text == "".join(deltas)
    deltas.append(det.flush())
    assert det.output_text == "".join(deltas)
    return deltas


def test_trained_bpe_splits_characters_across_tokens() -> None:
    bpe = TOKENIZERS["bpe"]
    # Tokens that are not valid UTF-8 alone: merges inside and across multi-byte characters.
    partial = [
        i for i in range(bpe.vocab_size) if len(bpe.id_to_token(i)) > 1 and "\ufffd" in bpe.decode([i])
    ]
    assert len(partial) > 10
    assert any("\ufffd" in bpe.decode([i]) for i in bpe.encode("日本語 😀 café"))


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
@settings(max_examples=150, deadline=None)
@given(text=st.one_of(texts, mixed_texts), data=st.data())
def test_stream_equals_full_decode(name: str, text: str, data: st.DataObject) -> None:
    tok = TOKENIZERS[name]
    ids = tok.encode(text, add_special_tokens=False)
    chunk_sizes = data.draw(st.lists(st.integers(1, 4), max_size=len(ids)))
    deltas = stream(IncrementalDetokenizer(tok, []), ids, chunk_sizes)
    assert "".join(deltas) == tok.decode(ids) == text
    # Every committed prefix is final: no U+FFFD halves of a character split across tokens.
    assert all(text.startswith("".join(deltas[:n])) for n in range(len(deltas)))


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
@settings(max_examples=75, deadline=None)
@given(prompt=mixed_texts, text=mixed_texts)
def test_stream_after_prompt_equals_full_decode(name: str, prompt: str, text: str) -> None:
    tok = TOKENIZERS[name]
    prompt_ids = tok.encode(prompt, add_special_tokens=False)
    ids = tok.encode(text, add_special_tokens=False)
    full = tok.decode(prompt_ids + ids)
    prompt_text = tok.decode(prompt_ids)
    assert full.startswith(prompt_text)
    assert "".join(stream(IncrementalDetokenizer(tok, prompt_ids), ids)) == full[len(prompt_text) :]


def test_leading_space_kept_after_prompt() -> None:
    spm = TOKENIZERS["spm"]
    prompt_ids = spm.encode("say", add_special_tokens=False)
    ids = spm.encode("the end", add_special_tokens=False)[:1]
    assert spm.decode(ids) == "the"
    assert IncrementalDetokenizer(spm, prompt_ids).add_tokens(ids) == " the"
    assert IncrementalDetokenizer(spm, []).add_tokens(ids) == "the"


def test_emoji_held_until_complete(tiny: Tokenizer) -> None:
    det = IncrementalDetokenizer(tiny, tiny.encode("hi"))
    ids = tiny.encode("a😀b", add_special_tokens=False)
    assert len(ids) == 6
    assert [det.add_tokens([i]) for i in ids] == ["a", "", "", "", "😀", "b"]


def test_decode_window_is_bounded() -> None:
    counting = CountingTokenizer(build_tiny_tokenizer())
    text = "日本語 😀 text " * 200
    ids = counting.encode(text, add_special_tokens=False)
    det = IncrementalDetokenizer(counting, ids[:100])
    assert "".join(det.add_tokens([i]) for i in ids) + det.flush() == text
    # The prompt context plus the bytes of one held character, however long the text.
    assert max(counting.decode_lengths) <= PROMPT_CONTEXT_TOKENS + 4


def test_invalid_bytes_are_committed_as_replacement(tiny: Tokenizer) -> None:
    det = IncrementalDetokenizer(tiny, [])
    assert det.add_tokens([0xF0]) == ""
    assert det.add_tokens([ord("a")]) == "\ufffda"
    garbage = [0x80] * (MAX_HELD_TOKENS + 3)
    deltas = [det.add_tokens([i]) for i in garbage]
    assert "".join(deltas) + det.flush() == tiny.decode(garbage)
    assert "".join(deltas[:MAX_HELD_TOKENS]) != ""
    det = IncrementalDetokenizer(tiny, [])
    assert det.add_tokens([0xE4, 0xB8]) == ""
    assert det.flush() == tiny.decode([0xE4, 0xB8]) == "\ufffd"


def test_special_and_unknown_ids(tiny: Tokenizer) -> None:
    ids = [ord("a"), EOS_TOKEN_ID, 300, 383, ord("b"), END_TOKEN_ID]
    det = IncrementalDetokenizer(tiny, [])
    assert [det.add_tokens([i]) for i in ids] == ["a", "", "", "", "b", ""]
    det = IncrementalDetokenizer(tiny, [], skip_special_tokens=False)
    assert "".join(stream(det, ids)) == "a</s>b<|end|>"


def test_runs_of_invisible_ids_do_not_grow_window() -> None:
    counting = CountingTokenizer(build_tiny_tokenizer())
    det = IncrementalDetokenizer(counting, [])
    for _ in range(500):
        det.add_tokens([300, EOS_TOKEN_ID])
    assert det.add_tokens([ord("x")]) == "x"
    assert max(counting.decode_lengths) <= 2


def test_stop_string_truncates(tiny: Tokenizer) -> None:
    ids = tiny.encode("Hello STOP world", add_special_tokens=False)
    det = IncrementalDetokenizer(tiny, [], stop=("STOP",))
    deltas = stream(det, ids)
    assert "".join(deltas) == det.output_text == "Hello "
    assert det.stopped_by == "STOP"
    assert deltas[-1] == ""  # flush after stop releases nothing
    assert det.add_tokens(tiny.encode("more", add_special_tokens=False)) == ""


def test_stop_string_included(tiny: Tokenizer) -> None:
    ids = tiny.encode("Hello STOP world", add_special_tokens=False)
    det = IncrementalDetokenizer(tiny, [], stop=("STOP",), include_stop_str_in_output=True)
    assert "".join(stream(det, ids)) == "Hello STOP"
    assert det.stopped_by == "STOP"


def test_partial_stop_is_held_then_flushed(tiny: Tokenizer) -> None:
    det = IncrementalDetokenizer(tiny, [], stop=("STOP", "##"))
    ids = tiny.encode("Hi ST", add_special_tokens=False)
    assert [det.add_tokens([i]) for i in ids] == ["H", "i", " ", "", ""]
    assert det.add_tokens([ord("#")]) == "ST"
    assert det.add_tokens([ord("x")]) == "#x"
    assert det.add_tokens([ord("S")]) == ""
    assert det.flush() == "S"
    assert det.output_text == "Hi ST#xS" and det.stopped_by is None


def test_stop_string_across_multibyte_tokens() -> None:
    bpe = TOKENIZERS["bpe"]
    text = "日本語のテキストと中文的文本 😀😃😄 done"
    ids = bpe.encode(text, add_special_tokens=False)
    det = IncrementalDetokenizer(bpe, [], stop=("と中", "😃"))
    deltas = stream(det, ids)
    assert "".join(deltas) == "日本語のテキスト"
    assert det.stopped_by == "と中"
    assert all("\ufffd" not in d for d in deltas)


def test_earliest_ending_stop_wins_regardless_of_batching(tiny: Tokenizer) -> None:
    ids = tiny.encode("xabcd", add_special_tokens=False)
    for sizes in ([len(ids)], [1] * len(ids), [2, 3]):
        det = IncrementalDetokenizer(tiny, [], stop=("abcd", "bc", "abc"))
        assert "".join(stream(det, ids, sizes)) == "x"
        assert det.stopped_by == "abc"


def reference_stop(text: str, stops: Sequence[str], include: bool) -> tuple[str, str | None]:
    for end in range(1, len(text) + 1):
        matches = [s for s in stops if s and text[:end].endswith(s)]
        if matches:
            stop = max(matches, key=len)
            return (text[:end] if include else text[: end - len(stop)]), stop
    return text, None


@settings(max_examples=400, deadline=None)
@given(
    text=st.text("ab c😀", max_size=30),
    stops=st.lists(st.text("ab c😀", min_size=1, max_size=4), min_size=1, max_size=3),
    include=st.booleans(),
    data=st.data(),
)
def test_stop_strings_match_reference(
    tiny: Tokenizer, text: str, stops: list[str], include: bool, data: st.DataObject
) -> None:
    ids = tiny.encode(text, add_special_tokens=False)
    chunk_sizes = data.draw(st.lists(st.integers(1, 6), max_size=len(ids)))
    expected, expected_stop = reference_stop(text, stops, include)
    det = IncrementalDetokenizer(tiny, [], stop=tuple(stops), include_stop_str_in_output=include)
    deltas, pos = [], 0
    for size in chunk_sizes + [1] * len(ids):
        if pos >= len(ids):
            break
        deltas.append(det.add_tokens(ids[pos : pos + size]))
        pos += size
        # Never emits text that a stop string will later remove.
        assert expected.startswith(det.output_text)
    deltas.append(det.flush())
    assert "".join(deltas) == det.output_text == expected
    assert det.stopped_by == expected_stop


@given(text=st.text("ab😀", max_size=12))
def test_without_stop_strings_nothing_is_held(tiny: Tokenizer, text: str) -> None:
    det = IncrementalDetokenizer(tiny, [], stop=("",))
    ids = tiny.encode(text, add_special_tokens=False)
    assert "".join(det.add_tokens([i]) for i in ids) == text
    assert det.flush() == ""


def test_tiny_checkpoint_tokenizer(tiny: Tokenizer, tmp_path: Path) -> None:
    prompt = tiny.encode(
        tiny.apply_chat_template([{"role": "user", "content": "hi"}]), add_special_tokens=False
    )
    det = IncrementalDetokenizer(tiny, prompt, stop=("<|end|>",), skip_special_tokens=False)
    ids = tiny.encode("答え: 42<|end|>\n", add_special_tokens=False)
    assert "".join(stream(det, ids)) == "答え: 42"
    assert det.stopped_by == "<|end|>"


def test_special_token_text_round_trip():
    tok = TOKENIZERS["tiny"]
    ids = tok.encode("a<|user|>b", add_special_tokens=False)
    assert 258 in ids
    assert tok.decode(ids) == "ab" and tok.decode(ids, skip_special_tokens=False) == "a<|user|>b"
    assert "".join(stream(IncrementalDetokenizer(tok, []), ids)) == "ab"
