"""Model family (Llama/Mistral/Qwen2), HF checkpoint loading, tokenizer and the embedded `tiny` model."""

from pdserve.models.config import ModelConfig, load_model_config
from pdserve.models.llama import MODEL_REGISTRY, LlamaForCausalLM
from pdserve.models.loader import load_model

__all__ = ["MODEL_REGISTRY", "LlamaForCausalLM", "ModelConfig", "load_model", "load_model_config"]
