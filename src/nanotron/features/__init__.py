"""Training features: parts of a run that the trainer calls through the step hooks of ``hooks.py`` and never names.

``fp8.py``      FP8 products (``fp8`` section): the model converter, the amax histories, the out-of-range metrics
``doremi.py``   DoReMi (``doremi`` section): the domain mixture, and the proxy's weighted loss and domain weights
``expert_balance.py``  the balancing bias of experts routed by sigmoid scores (DeepSeek-V3's ``bias_update_speed``)
"""

from __future__ import annotations

from nanotron.config import Config
from nanotron.features.doremi import DomainMixture, DoReMiProxy
from nanotron.features.expert_balance import ExpertBalance
from nanotron.features.fp8 import FP8
from nanotron.training.hooks import Feature


def features_for(config: Config, doremi_proxy: bool = False) -> list[Feature]:
    """The features a config asks for; ``doremi_proxy``: train DoReMi's proxy (``nanotron doremi train``), which
    checks its reference checkpoint and domains here, before anything is allocated."""
    features: list[Feature] = []
    if config.fp8 is not None and config.fp8.enabled:
        features.append(FP8(config.fp8))
    experts = config.model.model_config.moe
    if experts is not None and experts.scoring == "sigmoid" and experts.bias_update_speed > 0:
        features.append(ExpertBalance(experts))
    if doremi_proxy:
        features.append(DoReMiProxy(config))
    elif config.doremi is not None:
        features.append(DomainMixture(config.doremi))
    return features
