"""The settings that name a set of parts (engine/ops/settings.py): TRELLIS_CHAIN's links and
TRELLIS_OPEN_SUMS's readers read 0 / 1 / a comma list the same way, and a typo turns nothing on."""
import pytest

from engine.ops import chain, open_sums


@pytest.mark.parametrize("parse,kinds", [(chain.parse_setting, chain.LINKS), (open_sums.parse_setting, open_sums.KINDS)])
def test_none_all_or_a_list(parse, kinds):
    assert parse("0") == frozenset() == parse("") == parse(" off ")
    assert parse("1") == kinds == parse("all") == parse(",".join(sorted(kinds)).upper())
    one = sorted(kinds)[0]
    assert parse(f" {one} ") == {one}


@pytest.mark.parametrize("parse,name", [(chain.parse_setting, "TRELLIS_CHAIN"), (open_sums.parse_setting, "TRELLIS_OPEN_SUMS")])
def test_an_unknown_part_turns_everything_off_with_a_warning(parse, name):
    with pytest.warns(UserWarning, match=f"{name}='sometimes' not understood"):
        assert parse("sometimes") == frozenset()
    with pytest.warns(UserWarning, match="not understood"):
        assert parse("attn,gated,nonsense") == frozenset()


def test_chain_links():
    assert chain.parse_setting("attn") == {"attn"}
    assert chain.parse_setting("gated, normed") == {"gated", "normed"}
