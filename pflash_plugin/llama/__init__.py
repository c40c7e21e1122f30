"""Typed wrappers over llama_cpp.llama_cpp: the only package that touches ctypes."""
from .backend import init_backend
from .batch import Batch
from .context import Context, ContextConfig, DecodeError
from .model import Model, ModelParams, RopeParams
from .sampler import DRY_TEMPLATES, Dry, DynaTemp, GrammarError, GrammarExhausted, GrammarTooSlow, SamplerChain, \
    SamplerParams, Xtc, check_grammar

__all__ = ["Batch", "Context", "ContextConfig", "DecodeError", "DRY_TEMPLATES", "Dry", "DynaTemp", "GrammarError",
           "GrammarExhausted", "GrammarTooSlow", "Model", "ModelParams", "RopeParams", "SamplerChain", "SamplerParams",
           "Xtc", "check_grammar", "init_backend"]
