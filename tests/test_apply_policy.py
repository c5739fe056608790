"""Parsing checkpoint policies: names, compact per-block lists, JSON, files, and clear errors."""
import json

import pytest

from memfit.apply.policy import BlockAction, parse_items, resolve_policy, segments, to_json, to_string
from memfit.core.errors import ConfigError

K, R, S = BlockAction("keep"), BlockAction("recompute"), BlockAction("selective")


def test_named_policies():
    assert resolve_policy("none", 3) == [K, K, K]
    assert resolve_policy("full", 3) == [R, R, R]
    assert resolve_policy("selective", 2) == [S, S]
    assert resolve_policy("every:2", 5) == [R, K, R, K, R]
    assert resolve_policy("full+offload:disk", 2) == [BlockAction("recompute", offload="disk")] * 2
    assert resolve_policy("none+compress:int8", 1) == [BlockAction("keep", compress="int8")]


def test_sqrt_makes_about_sqrt_L_contiguous_segments():
    for n in (4, 9, 12, 16, 24, 48):
        regions = segments(resolve_policy("sqrt", n))
        assert abs(len(regions) - n ** 0.5) <= 1, (n, regions)
        assert [i for r in regions for i in r] == list(range(n))


def test_compact_list_with_repeats_modifiers_and_segments():
    got = resolve_policy("keep*2,selective,recompute+offload:disk+compress:int8,compress:fp8,recompute+seg=3*2", 7)
    assert got[:3] == [K, K, S]
    assert got[3] == BlockAction("recompute", offload="disk", compress="int8")
    assert got[4] == BlockAction("keep", compress="fp8")
    assert got[5] == got[6] == BlockAction("recompute", segment=3)
    assert segments(got) == [[0], [1], [2], [3], [4], [5, 6]]
    # the compact form and the JSON form round-trip
    assert resolve_policy(to_string(got), 7) == got
    assert resolve_policy(to_json(got), 7) == got
    assert to_string([K, K, R]) == "keep*2,recompute"


def test_single_item_applies_to_every_block_and_json_file(tmp_path):
    assert resolve_policy("recompute+offload:cpu", 3) == [BlockAction("recompute", offload="cpu")] * 3
    f = tmp_path / "plan.json"
    f.write_text(json.dumps([{"mode": "keep"}, {"mode": "recompute", "offload": "disk"}, "selective"]))
    assert resolve_policy(str(f), 3) == [K, BlockAction("recompute", offload="disk"), S]
    assert resolve_policy([K, R], 2) == [K, R]
    assert resolve_policy([{"mode": "selective", "repeat": 2}], 2) == [S, S]


@pytest.mark.parametrize(
    "bad, fragment",
    [
        ("fulll", "unknown block mode 'fulll'"),
        ("every:0", "every:K needs an integer K >= 1"),
        ("keep*0", "repeat count"),
        ("recompute+offload:tape", "unknown offload target 'tape'"),
        ("keep+compress:int4", "unknown compression 'int4'"),
        ("keep+fast", "bad modifier 'fast'"),
        ("keep+seg=1", "seg= is only meaningful for recompute"),
        ("recompute+seg=0,keep,recompute+seg=0", "not contiguous"),
        ("recompute+seg=0,recompute+seg=0+offload:cpu,keep", "share offload/compress"),
        ("keep,keep", "lists 2 block actions but the model has 3 blocks"),
        ("[{\"mode\": \"keep\",", "not valid JSON"),
        ("[{\"mode\": \"keep\", \"speed\": 1}]", "unknown keys ['speed']"),
        ("missing.json", "does not exist"),
        ("", "bad block action"),
    ],
)
def test_malformed_policies_say_what_is_wrong_and_what_is_accepted(bad, fragment):
    with pytest.raises(ConfigError) as exc:
        resolve_policy(bad, 3)
    msg = str(exc.value)
    assert fragment in msg
    assert "\n" not in msg


def test_errors_list_accepted_forms():
    with pytest.raises(ConfigError, match="accepted: none, full, every:K, sqrt, selective"):
        parse_items("bogus")
    with pytest.raises(ConfigError, match="must be a string or a list"):
        parse_items(3)


def test_wrapper_is_recompute_with_the_cache_left_on():
    """torch's checkpoint_wrapper per block: every block recomputed, a Hugging Face KV cache as configured."""
    W = BlockAction("recompute", cache=True)
    assert resolve_policy("wrapper", 3) == [W, W, W]
    assert resolve_policy("keep,recompute+cache", 2) == [K, W]
    assert resolve_policy(to_string([K, W]), 2) == [K, W] and resolve_policy(to_json([K, W]), 2) == [K, W]
    assert "cache" not in to_json([R])
    with pytest.raises(ConfigError, match="only meaningful for recompute"):
        resolve_policy("keep+cache", 1)
