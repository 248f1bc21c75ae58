"""A search type from outside the library: one module that registers itself is enough for the
config and the public Decoder API to decode with it (docs/architecture.md)."""

import numpy as np
import pytest

from gpudecode import defaults
from gpudecode.config import ConfigError, validate_config
from gpudecode.decoder import Decoder
from gpudecode.search import registry


@pytest.fixture()
def toy_search():
    from tests.plugins import toy_search

    registry.register_search(toy_search.TOY_SEARCH)  # again after an earlier test's unregister
    yield toy_search
    registry.unregister_search(toy_search.NAME)


def _config(tmp_path, search_type, **search):
    vocabulary = tmp_path / "vocab.txt"
    vocabulary.write_text("".join(f"w{i}\n" for i in range(5)))
    return {"models": {"vocabulary": {"path": str(vocabulary)}},
            "search": {"type": search_type, **search}}


def test_a_registered_search_type_decodes_through_the_decoder(tmp_path, toy_search):
    features = {"a": np.eye(5, dtype=np.float32)[[1, 1, 3, 0, 4]],
                "b": np.eye(5, dtype=np.float32)[[2, 2, 2]]}
    decoder = Decoder.from_config(_config(tmp_path, toy_search.NAME, options={"min_label": 1}))
    assert decoder.search_options == toy_search.ToyOptions(min_label=1)
    nbest = decoder.decode(features)
    assert [h.labels for h in nbest["a"]] == [[1, 3, 4]]
    assert [h.labels for h in nbest["b"]] == [[2]]
    assert nbest["a"][0].score == pytest.approx(5.0)


def test_the_registry_checks_what_a_type_requires(tmp_path, toy_search):
    config = _config(tmp_path, toy_search.NAME)
    config["scorers"] = [{"type": "length-reward", "scale": 1.0}]
    with pytest.raises(ConfigError, match="scorers: the toy search fuses no scorers"):
        Decoder.from_config(config)


def test_an_unregistered_type_is_refused_by_the_config(tmp_path):
    with pytest.raises(ConfigError, match=r"search.type: invalid choice 'toy-best-labels?'.*valid choices: "
                                          r"label-sync, ctc-prefix"):
        validate_config(_config(tmp_path, "toy-best-labels"))


def test_the_search_types_are_the_registry_s():
    assert registry.search_type_names()[:len(registry.BUILTIN_SEARCH_TYPES)] == registry.BUILTIN_SEARCH_TYPES
    assert defaults.SEARCH_TYPE in registry.BUILTIN_SEARCH_TYPES
    assert not hasattr(defaults, "SEARCH_TYPES")
    for name in registry.BUILTIN_SEARCH_TYPES:
        search_type = registry.search_type(name)
        assert search_type.name == name and search_type.options_class is not None
    with pytest.raises(ValueError, match="already registered"):
        registry.register_search(registry.SearchType(name="label-sync", decode=lambda setup, batch: []))
