"""The plugin's configuration: keys and aliases of the public plugin, closed per-connector
schemas, and one message per mistake naming the key and what to change."""

from __future__ import annotations

from typing import Any

import pytest

from afd_vllm.config import AFDConfig, parse_afd_config
from afd_vllm.extra import (
    SCHEMAS,
    AFDConfigError,
    CamExtraConfig,
    GpuExtraConfig,
    HostExtraConfig,
)


def _parse(**afd: Any) -> AFDConfig:
    config = parse_afd_config({"afd": afd})
    assert config is not None
    return config


def test_nothing_applies_without_an_afd_entry() -> None:
    assert parse_afd_config(None) is None
    assert parse_afd_config({}) is None
    assert parse_afd_config({"other_plugin": {"x": 1}}) is None


def test_the_public_plugins_keys_and_aliases_are_accepted() -> None:
    config = _parse(
        afd_role="ffn",
        afd_connector="HostAsyncAFDConnector",
        afd_host="localhost",
        afd_port=4242,
        num_attention_ranks=4,
        num_ffn_ranks=2,
        compute_gate_on_attention="yes",
        **{"async": 1},
        connector_extra_config={"attn_ranks_per_dp": 2, "async_moe_ubatching": "on"},
    )
    assert (config.role, config.connector, config.host, config.port) == (
        "ffn",
        "HostAsyncAFDConnector",
        "localhost",
        4242,
    )
    assert isinstance(config.extra, HostExtraConfig)
    assert config.extra.attn_ranks_per_dp == 2
    assert config.extra.num_stages == 2
    assert config.is_attention is False


def test_defaults_are_the_documented_ones() -> None:
    config = _parse()
    assert config == AFDConfig()
    assert isinstance(config.extra, GpuExtraConfig)
    assert config.extra.num_stages == 1
    assert (config.extra.wire_format, config.extra.combine_reduce) == ("per_rank", "ffn")


@pytest.mark.parametrize(
    ("afd", "message"),
    [
        ({"rol": "ffn"}, "unknown key afd.rol; the keys are ["),
        ({"role": "ffn", "afd_role": "ffn"}, "afd.role is given twice"),
        ({"role": "expert"}, "afd.role must be one of ['attention', 'ffn'], got 'expert'"),
        ({"connector": "P2pNcclAFDConnector"}, "afd.connector must be one of"),
        ({"port": 0}, "afd.port must be in 1..65535, got 0"),
        ({"port": True}, "afd.port must be a whole number, got True"),
        ({"port": 12.5}, "afd.port must be a whole number, got 12.5"),
        ({"num_ffn_ranks": 0}, "afd.num_ffn_ranks must be >= 1, got 0"),
        ({"compute_gate_on_attention": False}, "afd.compute_gate_on_attention must be true"),
        ({"async": "off"}, "afd.async must be true"),
        ({"async": "maybe"}, "afd.async_dp must be true or false, got 'maybe'"),
        ({"host": ""}, "afd.host must be a host name or address"),
        ({"connector_extra_config": [1]}, "afd.connector_extra_config must be a JSON object"),
        (
            {"num_attention_ranks": 3, "connector_extra_config": {"attn_ranks_per_dp": 2}},
            "afd.num_attention_ranks (3) must be a multiple of connector_extra_config."
            "attn_ranks_per_dp (2)",
        ),
    ],
)
def test_each_mistake_is_one_message_naming_the_key(afd: dict[str, Any], message: str) -> None:
    with pytest.raises(AFDConfigError) as caught:
        parse_afd_config({"afd": afd})
    assert message in str(caught.value)
    assert "\n" not in str(caught.value)


def test_the_afd_entry_must_be_an_object_and_the_role_the_expected_one() -> None:
    with pytest.raises(AFDConfigError, match="additional_config\\['afd'\\] must be a JSON object"):
        parse_afd_config({"afd": "attention"})
    with pytest.raises(AFDConfigError, match=r"this process runs the ffn role but afd\.role is"):
        parse_afd_config({"afd": {"role": "attention"}}, expected_role="ffn")


@pytest.mark.parametrize(
    ("connector", "extra", "message"),
    [
        (
            "CAMAsyncAFDConnector",
            {"wire_format": "per_rank"},
            "unknown key afd.connector_extra_config.wire_format for CAMAsyncAFDConnector; "
            "its keys are [",
        ),
        ("CAMAsyncAFDConnector", {"dynamicQuant": 2}, "must be one of [0, 1], got 2"),
        ("GpuAsyncAFDConnector", {"ring_depth": 0}, "ring_depth must be in 1..64, got 0"),
        (
            "GpuAsyncAFDConnector",
            {"routed_cap_multiplier": 0.5},
            "routed_cap_multiplier must be in 1..1024, got 0.5",
        ),
        ("HostAsyncAFDConnector", {"async_moe_split": "request"}, "must be one of ['token']"),
        ("HostAsyncAFDConnector", {"rendezvous_dir": 3}, "rendezvous_dir must be a string"),
        (
            "GpuAsyncAFDConnector",
            {"async_moe_ubatching": True, "async_moe_num_ubatches": 4, "ring_depth": 2},
            "ring_depth (2) must be at least async_moe_num_ubatches (4)",
        ),
    ],
)
def test_connector_schemas_are_closed_and_ranged(
    connector: str, extra: dict[str, Any], message: str
) -> None:
    with pytest.raises(AFDConfigError) as caught:
        parse_afd_config({"afd": {"connector": connector, "connector_extra_config": extra}})
    assert message in str(caught.value)


def test_every_schema_describes_each_key_with_a_default_and_a_meaning() -> None:
    assert set(SCHEMAS) == {
        "GpuAsyncAFDConnector",
        "CAMAsyncAFDConnector",
        "HostAsyncAFDConnector",
    }
    cam = CamExtraConfig.describe()
    assert cam["dynamicQuant"]["default"] == 0
    for schema in SCHEMAS.values():
        for key, spec in schema.describe().items():
            assert spec["doc"], key
