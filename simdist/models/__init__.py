"""Model registry: params.yaml's ``model.name`` -> model class."""

from __future__ import annotations

from simdist.config import ConfigError


def build_model(config):
    if config.name == "fc_mnist":
        from .fc_mnist import FCMNIST

        try:
            return FCMNIST(config)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if config.name == "gpt2":
        from .gpt2 import build_gpt2

        return build_gpt2(config)
    if config.name == "bert":
        from .bert import build_bert

        return build_bert(config)
    if config.name == "t5":
        from .t5 import build_t5

        return build_t5(config)
    if config.name == "transformer":
        from .transformer import build_transformer

        return build_transformer(config)
    raise ConfigError(f"model.name: unknown model {config.name!r}")
