"""Every named system is accepted by the server's config validation (no server started)."""
import json

import pytest

from mosaickv_sglang.config import MosaicConfig
from mosaickv_sglang.eval import systems
from mosaickv_sglang.eval.systems import MASK_MATCH, SYSTEMS, _segment_bytes


@pytest.mark.parametrize("name", list(SYSTEMS))
def test_system_config_is_valid(name):
    s = SYSTEMS[name]
    systems.validate(s)  # parse + every candidate encodes a SmolLM2 (head_dim 64) segment
    args = s.server_args()
    assert args[:2] == ["--kv-backend", s.kv_backend]
    if "--mosaickv-config" in args:  # the exact text the server's CLI parser gets
        text = args[args.index("--mosaickv-config") + 1]
        assert MosaicConfig.parse(text).to_dict() == s.mosaic_config().to_dict()
    if s.kv_backend == "default":
        assert s.mosaic_config() is None and s.nominal_ratio


def test_ablations_differ_from_the_default_in_one_thing():
    d = MosaicConfig().to_dict()
    def diff(name):
        return {k for k, v in SYSTEMS[name].mosaic_config().to_dict().items() if d[k] != v}
    assert diff("mosaickv") == set()
    assert diff("channel_only") == {"select"} and not SYSTEMS["channel_only"].mosaic_config().select.enabled
    assert diff("no_rotation") == {"fit_solver"}
    assert SYSTEMS["no_rotation"].mosaic_config().fit_solver == "identity"
    assert diff("global_mask") == {"k_candidates", "v_candidates", "k_error_budget", "v_error_budget"}
    assert diff("mosaickv_k4") == {"k_candidates"}
    k4 = SYSTEMS["mosaickv_k4"].config["k_candidates"]
    assert k4 and set(k4) < set(d["k_candidates"]) and all(",b2=0," in c for c in k4)
    sel = SYSTEMS["selection_only"].mosaic_config()
    assert sel.k_candidates == sel.v_candidates == [systems.NEAR_LOSSLESS] == sel.sink_candidates
    assert sel.select.enabled and sel.select.budget_tokens == 2048


def test_global_mask_bytes_match_the_band_it_replaces():
    r = systems.matched_mask_r()
    assert SYSTEMS["global_mask"].config["k_candidates"] == [f"mask:r={r}"]
    assert abs(_segment_bytes(f"mask:r={r}", 64) / _segment_bytes(MASK_MATCH, 64) - 1) < 0.05


def test_budget_systems_span_a_curve():
    bits = [_segment_bytes(SYSTEMS[n].config["k_candidates"][0], 64)
            for n in ("mosaickv_hi", "mosaickv_lo", "mosaickv_xlo")]
    assert bits == sorted(bits, reverse=True) and bits[0] > 1.5 * bits[-1]


def test_unknown_system_is_named():
    with pytest.raises(ValueError, match=r"unknown system\(s\) \['fp4'\]"):
        systems.get(["dense", "fp4"])
    assert json.loads(SYSTEMS["global_mask"].server_args()[3])["k_error_budget"] >= 1e9


def test_read_rule_ablations_set_every_key_they_describe():
    """The read-rule ablations name a rule, a basis fit and a window: each sets all three, so a
    change of the defaults cannot silently turn one into the default config."""
    from mosaickv_sglang.eval.systems import SYSTEMS

    ablations = [s for s in SYSTEMS.values() if s.name.startswith("mosaickv_chunk")]
    assert len(ablations) == 3
    for system in ablations:
        assert {"read_rule", "basis_fit", "hot_tokens"} <= set(system.config), system.name
