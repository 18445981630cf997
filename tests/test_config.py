from dataclasses import dataclass, field

import pytest

from pipeline.config import ConfigError, from_dict, load_config, to_dict


@dataclass(frozen=True)
class Inner:
    k: int = 4
    sigma: float = 0.05
    method: str = "perturbed"


@dataclass(frozen=True)
class Outer:
    name: str = "x"
    inner: Inner = field(default_factory=Inner)
    sizes: tuple[int, ...] = (1, 2)


def test_from_dict_nested_and_roundtrip():
    cfg = from_dict(Outer, {"name": "a", "inner": {"k": 8, "sigma": 1}, "sizes": [3]})
    assert cfg.inner.k == 8 and cfg.inner.sigma == 1.0 and isinstance(cfg.inner.sigma, float)
    assert cfg.sizes == (3,)
    assert from_dict(Outer, to_dict(cfg)) == cfg


def test_unknown_key_rejected_with_allowed_list():
    with pytest.raises(ConfigError, match=r"inner\.kk.*allowed: \['k', 'method', 'sigma'\]"):
        from_dict(Outer, {"inner": {"kk": 1}})


def test_wrong_type_names_expected_and_given():
    with pytest.raises(ConfigError, match="inner.k: expected an integer, got str 'ten'"):
        from_dict(Outer, {"inner": {"k": "ten"}})


def test_yaml_and_overrides(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("name: y\ninner:\n  k: 2\n")
    cfg = load_config(Outer, p, ["inner.sigma=0.5", "inner.method=lapsum"])
    assert (cfg.name, cfg.inner.k, cfg.inner.sigma, cfg.inner.method) == ("y", 2, 0.5, "lapsum")
    with pytest.raises(ConfigError, match="expects key=value"):
        load_config(Outer, p, ["inner.sigma"])
    with pytest.raises(ConfigError, match="not found"):
        load_config(Outer, tmp_path / "missing.yaml")


def test_fixed_length_tuples_take_each_item_with_its_own_type():
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class Pair:
        t: tuple[float, int] = (0.0, 0)

    assert from_dict(Pair, {"t": [1.5, 2]}) == Pair(t=(1.5, 2))
    with pytest.raises(ConfigError, match=r"t\[1\]: expected an integer"):
        from_dict(Pair, {"t": [1.5, 2.5]})
