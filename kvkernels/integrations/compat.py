"""Names that changed across Hugging Face transformers 5.x releases (imports transformers only when called)."""

import functools


@functools.cache
def cache_kwarg() -> str:
    """The keyword under which generate() and a model's forward take the cache: "cache" from transformers 5.24 (where
    "past_key_values" is deprecated and GenerateDecoderOnlyOutput's field is renamed), "past_key_values" before."""
    from transformers.generation import utils

    return "cache" if "cache" in getattr(utils, "ALL_CACHE_NAMES", ()) else "past_key_values"


def cache_from(kwargs: dict):
    """The cache in generate()'s model kwargs (a custom_generate callable's), under either name."""
    return kwargs.get(cache_kwarg(), kwargs.get("past_key_values"))
