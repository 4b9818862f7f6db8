"""Strategy option dicts (``speculative={...}``, ``wedlm={...}``, ``--decoding-options``) are
validated up front: an unknown key or a bad value raises ``ValueError`` naming it."""

from __future__ import annotations

import pytest

from ratchetlm.decoding.speculative.config import SpecConfig
from ratchetlm.decoding.wedlm_window import WeDLMConfig


@pytest.mark.parametrize("cls, what", [(SpecConfig, "speculative"), (WeDLMConfig, "wedlm")])
def test_unknown_option_is_named(cls, what):
    with pytest.raises(ValueError, match=rf"unknown {what} option\(s\) windw_size, zz; known: "):
        cls.from_options({"windw_size": 4, "zz": 1})


@pytest.mark.parametrize("cls, options, field", [
    (SpecConfig, {"method": "ngram", "depth": 0}, "depth"),
    (SpecConfig, {"method": "telepathy"}, "method"),
    (WeDLMConfig, {"window_size": 0}, "window_size"),
    (WeDLMConfig, {"entropy_threshold": -1.0}, "entropy_threshold"),
    (WeDLMConfig, {"position_penalty": -0.1}, "position_penalty"),
])
def test_bad_value_is_named(cls, options, field):
    with pytest.raises(ValueError, match=field):
        cls.from_options(options)


def test_known_options_pass_through():
    assert WeDLMConfig.from_options({"window_size": 4, "entropy_threshold": None}) == WeDLMConfig(4, None)
    assert SpecConfig.from_options({"method": "ngram", "depth": 3}).depth == 3


def test_default_depth_per_method():
    """n-gram drafts may reach 8 tokens (its gain schedule cuts them), MTP verifies 1, the rest 4."""
    assert SpecConfig.from_options({"method": "ngram"}).depth == 8
    assert SpecConfig.from_options({"method": "mtp"}).depth == 1
    assert SpecConfig.from_options({"method": "draft"}).depth == 4
