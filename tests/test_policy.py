"""Policy validation, the settings revision and generated ids (docs/policies.md)."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest

from django_quota.core.errors import ConfigurationError
from django_quota.core.policy import (
    Form,
    Policy,
    Selector,
    Window,
    canonical_definition,
    generated_policy_id,
    parse_policy,
    parse_selector,
    settings_revision,
    window_from_limit,
)

ORDERS: dict[str, Any] = {
    "algorithm": "fixed_window",
    "windows": {"burst": "10/s", "sustained": "1000/h"},
    "selector": ["user"],
}
KEY = "QUOTA['POLICIES']['orders']"


def orders(**changes: Any) -> dict[str, Any]:
    return {**ORDERS, **changes}


def rejection(raw: object, policy_id: object = "orders") -> ConfigurationError:
    with pytest.raises(ConfigurationError) as info:
        parse_policy(policy_id, raw)
    return info.value


# -- a valid policy ----------------------------------------------------------------------


def test_full_policy_parses_to_every_field() -> None:
    policy = parse_policy(
        "orders",
        {
            "algorithm": "token_bucket",
            "windows": {"burst": "10/s", "sustained": "1000/h"},
            "selector": ["ip", "user"],
            "routes": ["/api", "api:*"],
            "methods": ["POST", "PUT"],
            "enforcement": "shadow",
            "failure_mode": "open",
            "on_missing": "skip",
            "max_cost": 5,
            "capacity": {"burst": 20},
            "enabled": False,
        },
    )
    assert policy == Policy(
        id="orders",
        algorithm="token_bucket",
        windows=(
            Window("burst", 10, 1_000, 20),
            Window("sustained", 1000, 3_600_000, 1000),
        ),
        selector=("user", "ip"),
        routes=("/api", "api:*"),
        methods=("POST", "PUT"),
        enforcement="shadow",
        failure_mode="open",
        on_missing="skip",
        max_cost=5,
        enabled=False,
        revision="b6e511ab",
        source="settings",
    )
    assert policy.shadow is True
    assert policy.certainty == "exact"


def test_minimal_policy_takes_the_documented_defaults() -> None:
    policy = parse_policy("orders", {"windows": "10/s"})
    assert policy.algorithm == "fixed_window"
    assert policy.windows == (Window("default", 10, 1_000, 10),)
    assert policy.selector == ("auto",)
    assert policy.routes == ()
    assert policy.methods == ()
    assert policy.enforcement == "enforce"
    assert policy.failure_mode is None
    assert policy.on_missing == "deny"
    assert policy.max_cost is None
    assert policy.enabled is True
    assert policy.source == "settings"
    assert policy.shadow is False


def test_default_algorithm_can_be_chosen_by_the_caller() -> None:
    policy = parse_policy("view:x", {"windows": "1/s"}, default_algorithm="sliding_window")
    assert policy.algorithm == "sliding_window"
    assert policy.certainty == "approximate"


def test_source_is_recorded() -> None:
    assert parse_policy("orders", {"windows": "1/s"}, source="database").source == "database"


def test_policy_is_frozen() -> None:
    policy = parse_policy("orders", ORDERS)
    with pytest.raises(AttributeError):
        policy.id = "other"  # type: ignore[misc]


# -- ids and window names ----------------------------------------------------------------


@pytest.mark.parametrize(
    "policy_id",
    ["orders", "a", "0", "drf:anon", "view:app.views.index", "api-v1_orders.post:x", "a" * 64],
)
def test_policy_id_matching_the_grammar_is_accepted(policy_id: str) -> None:
    assert parse_policy(policy_id, {"windows": "1/s"}).id == policy_id


def test_policy_id_of_64_characters_is_accepted_and_65_rejected() -> None:
    assert parse_policy("x" * 64, {"windows": "1/s"}).id == "x" * 64
    error = rejection({"windows": "1/s"}, "x" * 65)
    assert error.key == f"QUOTA['POLICIES'][{'x' * 65!r}]"


@pytest.mark.parametrize(
    "policy_id",
    [
        "Orders",
        "ORDERS",
        "",
        "_orders",
        "-orders",
        ".orders",
        ":orders",
        "or ders",
        "orders/1",
        "orders\n",
        "ordérs",
        None,
        1,
    ],
)
def test_policy_id_outside_the_grammar_is_rejected(policy_id: object) -> None:
    error = rejection({"windows": "1/s"}, policy_id)
    assert error.key == f"QUOTA['POLICIES'][{policy_id!r}]"
    assert "[a-z0-9][a-z0-9_.:-]{0,63}" in error.message


@pytest.mark.parametrize("name", ["burst", "b", "w1", "per_day", "a" + "b" * 31])
def test_window_name_matching_the_grammar_is_accepted(name: str) -> None:
    assert parse_policy("orders", {"windows": {name: "1/s"}}).windows[0].name == name


@pytest.mark.parametrize(
    "name", ["Burst", "1burst", "_burst", "burst-1", "bur st", "", "a" + "b" * 32, "burst\n", 1]
)
def test_window_name_outside_the_grammar_is_rejected(name: object) -> None:
    error = rejection({"windows": {name: "1/s"}})
    assert error.key == f"{KEY}['windows']"
    assert repr(name) in error.message


# -- windows -----------------------------------------------------------------------------


def test_single_rate_string_is_one_window_named_default() -> None:
    policy = parse_policy("orders", {"windows": "100/5m"})
    assert Form.DEFAULT_WINDOW == "default"
    assert policy.windows == (Window("default", 100, 300_000, 100),)


def test_windows_keep_declaration_order() -> None:
    policy = parse_policy(
        "orders", {"windows": {"sustained": "1000/h", "a": "5/d", "burst": "10/s"}}
    )
    assert [window.name for window in policy.windows] == ["sustained", "a", "burst"]
    assert [window.period_ms for window in policy.windows] == [3_600_000, 86_400_000, 1_000]


def test_window_period_is_reported_in_seconds() -> None:
    assert parse_policy("orders", {"windows": "1/5m"}).windows[0].period == 300.0


def test_empty_windows_dict_is_rejected() -> None:
    error = rejection({"windows": {}})
    assert error.key == f"{KEY}['windows']"
    assert "at least one window" in error.message


def test_missing_windows_is_rejected() -> None:
    error = rejection({"algorithm": "fixed_window"})
    assert error.key == f"{KEY}['windows']"


@pytest.mark.parametrize("windows", [None, ["10/s"], 10, ("burst", "10/s")])
def test_windows_of_another_type_are_rejected(windows: object) -> None:
    error = rejection({"windows": windows})
    assert error.key == f"{KEY}['windows']"


def test_invalid_rate_names_the_window_key() -> None:
    error = rejection({"windows": {"burst": "10/x", "sustained": "1000/h"}})
    assert error.key == "QUOTA['POLICIES']['orders']['windows']['burst']"
    assert str(error).startswith("QUOTA['POLICIES']['orders']['windows']['burst']: ")


def test_invalid_single_rate_names_the_windows_key() -> None:
    error = rejection({"windows": "0/s"})
    assert error.key == "QUOTA['POLICIES']['orders']['windows']"


def test_rate_bound_violation_names_the_window_key() -> None:
    error = rejection({"windows": {"year": "1000000000/366d"}})
    assert error.key == "QUOTA['POLICIES']['orders']['windows']['year']"


def test_burst_longer_than_sustained_is_rejected() -> None:
    error = rejection({"windows": {"burst": "100/h", "sustained": "10/m"}})
    assert error.key == f"{KEY}['windows']"
    assert "burst" in error.message and "sustained" in error.message


def test_burst_as_long_as_sustained_is_rejected() -> None:
    error = rejection({"windows": {"burst": "10/60s", "sustained": "100/m"}})
    assert error.key == f"{KEY}['windows']"


def test_burst_shorter_than_sustained_is_accepted() -> None:
    policy = parse_policy("orders", {"windows": {"burst": "10/59s", "sustained": "100/m"}})
    assert [window.name for window in policy.windows] == ["burst", "sustained"]


def test_burst_without_sustained_has_no_period_rule() -> None:
    policy = parse_policy("orders", {"windows": {"burst": "100/d", "short": "10/s"}})
    assert len(policy.windows) == 2


# -- unknown keys and choices ------------------------------------------------------------


def test_unknown_policy_key_is_rejected_naming_it() -> None:
    error = rejection(orders(window="10/s"))
    assert error.key == KEY
    assert error.message.startswith("unknown key(s) window;")


def test_several_unknown_policy_keys_are_all_named() -> None:
    error = rejection(orders(limit=5, rate="1/s"))
    assert "unknown key(s) limit, rate" in error.message


@pytest.mark.parametrize("raw", [None, "10/s", ["10/s"], 5])
def test_policy_that_is_not_a_dict_is_rejected(raw: object) -> None:
    error = rejection(raw)
    assert error.key == KEY


@pytest.mark.parametrize(
    "algorithm", ["fixed_window", "sliding_window", "sliding_log", "token_bucket"]
)
def test_each_algorithm_is_accepted(algorithm: str) -> None:
    policy = parse_policy("orders", orders(algorithm=algorithm))
    assert policy.algorithm == algorithm
    assert policy.certainty == ("approximate" if algorithm == "sliding_window" else "exact")


@pytest.mark.parametrize("algorithm", ["leaky_bucket", "Fixed_Window", "", None, 1])
def test_unknown_algorithm_is_rejected(algorithm: object) -> None:
    error = rejection(orders(algorithm=algorithm))
    assert error.key == f"{KEY}['algorithm']"


@pytest.mark.parametrize(
    ("field", "valid", "invalid"),
    [
        ("enforcement", ["enforce", "shadow"], ["ENFORCE", "dry_run", None, ""]),
        ("failure_mode", ["open", "closed", None], ["Open", "fail", ""]),
        ("on_missing", ["deny", "skip"], ["allow", None, "Deny"]),
    ],
)
def test_choice_fields_accept_only_their_choices(
    field: str, valid: list[object], invalid: list[object]
) -> None:
    for value in valid:
        assert getattr(parse_policy("orders", orders(**{field: value})), field) == value
    for value in invalid:
        error = rejection(orders(**{field: value}))
        assert error.key == f"{KEY}[{field!r}]"


@pytest.mark.parametrize("max_cost", [0, 1, 10**9])
def test_max_cost_non_negative_integer_is_accepted(max_cost: int) -> None:
    assert parse_policy("orders", orders(max_cost=max_cost)).max_cost == max_cost


@pytest.mark.parametrize("max_cost", [-1, 1.5, "3", True, False])
def test_max_cost_other_than_non_negative_integer_is_rejected(max_cost: object) -> None:
    error = rejection(orders(max_cost=max_cost))
    assert error.key == f"{KEY}['max_cost']"


@pytest.mark.parametrize("enabled", [1, 0, "yes", None])
def test_enabled_must_be_a_bool(enabled: object) -> None:
    error = rejection(orders(enabled=enabled))
    assert error.key == f"{KEY}['enabled']"


# -- routes and methods ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("routes", "expected"),
    [
        (None, ()),
        ([], ()),
        (["*"], ("*",)),
        (["/api", "api:*", "health"], ("/api", "api:*", "health")),
        (("/a",), ("/a",)),
    ],
)
def test_routes_are_kept_as_a_tuple(routes: object, expected: tuple[str, ...]) -> None:
    assert parse_policy("orders", orders(routes=routes)).routes == expected


@pytest.mark.parametrize("routes", ["/api", [""], [1], ["/api", None], {"/api": 1}])
def test_routes_other_than_a_list_of_strings_are_rejected(routes: object) -> None:
    error = rejection(orders(routes=routes))
    assert error.key == f"{KEY}['routes']"


def test_upper_case_methods_are_accepted() -> None:
    policy = parse_policy("orders", orders(methods=["GET", "HEAD", "OPTIONS", "PATCH"]))
    assert policy.methods == ("GET", "HEAD", "OPTIONS", "PATCH")


@pytest.mark.parametrize("methods", [["get"], ["Post"], ["GET", "put"], ["GET1"], ["G T"], ["GÉT"]])
def test_methods_that_are_not_upper_case_words_are_rejected(methods: list[str]) -> None:
    error = rejection(orders(methods=methods))
    assert error.key == f"{KEY}['methods']"


@pytest.mark.parametrize("methods", ["GET", [""], [1], {"GET": True}])
def test_methods_other_than_a_list_of_strings_are_rejected(methods: object) -> None:
    error = rejection(orders(methods=methods))
    assert error.key == f"{KEY}['methods']"


def test_methods_none_means_every_method_like_an_empty_list() -> None:
    assert parse_policy("orders", orders(methods=None)).methods == ()


# -- selector ----------------------------------------------------------------------------


def test_selector_is_returned_in_framing_order() -> None:
    selector = parse_selector(["ip", "api_key", "user", "tenant", "route"], "k")
    assert selector == ("route", "tenant", "user", "api_key", "ip")


def test_selector_order_does_not_change_the_policy() -> None:
    first = parse_policy("orders", orders(selector=["ip", "user"]))
    second = parse_policy("orders", orders(selector=["user", "ip"]))
    assert first.selector == second.selector == ("user", "ip")
    assert first.revision == second.revision


def test_selector_defaults_to_auto() -> None:
    assert parse_selector(None, "k") == (Selector.AUTO,)
    assert parse_policy("orders", {"windows": "1/s"}).selector == ("auto",)


def test_selector_given_as_one_string_is_one_dimension() -> None:
    assert parse_selector("user", "k") == ("user",)


@pytest.mark.parametrize(
    "selector", [["route", "auto"], ["auto", "tenant"], ["route", "tenant", "auto"]]
)
def test_auto_combines_with_route_and_tenant(selector: list[str]) -> None:
    assert parse_selector(selector, "k")[-1] == "auto"


@pytest.mark.parametrize("other", ["user", "api_key", "ip"])
def test_auto_combined_with_user_api_key_or_ip_is_rejected(other: str) -> None:
    with pytest.raises(ConfigurationError, match="auto") as info:
        parse_selector(["auto", other], "QUOTA['POLICIES']['orders']['selector']")
    assert info.value.key == "QUOTA['POLICIES']['orders']['selector']"


def test_unknown_dimension_is_rejected_naming_it() -> None:
    error = rejection(orders(selector=["user", "session"]))
    assert error.key == f"{KEY}['selector']"
    assert "'session'" in error.message


def test_repeated_dimension_is_rejected() -> None:
    error = rejection(orders(selector=["user", "user"]))
    assert error.key == f"{KEY}['selector']"
    assert "repeated" in error.message


def test_empty_selector_is_rejected() -> None:
    error = rejection(orders(selector=[]))
    assert error.key == f"{KEY}['selector']"


def test_internal_dimension_is_rejected_in_settings() -> None:
    error = rejection(orders(selector=["drf_cache_key"]))
    assert error.key == f"{KEY}['selector']"


def test_internal_dimension_is_accepted_for_the_library_layers() -> None:
    policy = parse_policy(
        "drf:anon",
        {"windows": "5/m", "selector": ["drf_cache_key"]},
        allow_internal_dimensions=True,
    )
    assert policy.selector == ("drf_cache_key",)


# -- capacity ----------------------------------------------------------------------------


def test_capacity_integer_applies_to_every_window() -> None:
    policy = parse_policy(
        "orders", orders(algorithm="token_bucket", capacity=50, windows={"a": "10/s", "b": "100/m"})
    )
    assert [window.capacity for window in policy.windows] == [50, 50]


def test_capacity_dict_sets_named_windows_and_leaves_others_at_limit() -> None:
    policy = parse_policy("orders", orders(algorithm="token_bucket", capacity={"sustained": 2000}))
    assert policy.windows == (
        Window("burst", 10, 1_000, 10),
        Window("sustained", 1000, 3_600_000, 2000),
    )


def test_capacity_defaults_to_limit() -> None:
    policy = parse_policy("orders", orders(algorithm="token_bucket"))
    assert [window.capacity for window in policy.windows] == [10, 1000]


@pytest.mark.parametrize("algorithm", ["fixed_window", "sliding_window", "sliding_log"])
def test_capacity_outside_token_bucket_is_rejected(algorithm: str) -> None:
    error = rejection(orders(algorithm=algorithm, capacity=20))
    assert error.key == f"{KEY}['capacity']"
    assert "token_bucket" in error.message


def test_capacity_for_an_unknown_window_is_rejected() -> None:
    error = rejection(orders(algorithm="token_bucket", capacity={"burts": 20}))
    assert error.key == f"{KEY}['capacity']"
    assert "'burts'" in error.message


@pytest.mark.parametrize("capacity", [0, -1, 1.5, "20", True])
def test_capacity_that_is_not_a_positive_integer_is_rejected(capacity: object) -> None:
    error = rejection(orders(algorithm="token_bucket", capacity=capacity))
    assert error.key == f"{KEY}['capacity']"


def test_capacity_dict_value_error_names_the_window() -> None:
    error = rejection(orders(algorithm="token_bucket", capacity={"burst": 0}))
    assert error.key == "QUOTA['POLICIES']['orders']['capacity']['burst']"


def test_capacity_times_period_over_two_to_the_52_is_rejected() -> None:
    # 142418 * 31_622_400_000 <= 2**52 < 142419 * 31_622_400_000
    ok = parse_policy(
        "orders", {"algorithm": "token_bucket", "windows": "10/366d", "capacity": 142_418}
    )
    assert ok.windows[0].capacity == 142_418
    error = rejection({"algorithm": "token_bucket", "windows": "10/366d", "capacity": 142_419})
    assert error.key == f"{KEY}['capacity']"
    assert "2**52" in error.message


# -- window_from_limit (the admin's form) ------------------------------------------------


def test_window_from_limit_builds_a_window_with_capacity_defaulting_to_limit() -> None:
    assert window_from_limit("burst", 10, 1_000, None, "k") == Window("burst", 10, 1_000, 10)
    assert window_from_limit("burst", 10, 1_000, 25, "k") == Window("burst", 10, 1_000, 25)


@pytest.mark.parametrize(
    ("limit", "period_ms", "capacity"),
    [(0, 1_000, None), (10, 999, None), (10, 1_000, 0), (10, 31_622_400_000, 142_419)],
)
def test_window_from_limit_enforces_the_same_bounds(
    limit: int, period_ms: int, capacity: int | None
) -> None:
    with pytest.raises(ConfigurationError) as info:
        window_from_limit("w", limit, period_ms, capacity, "QuotaWindow")
    assert info.value.key == "QuotaWindow"


# -- revision ----------------------------------------------------------------------------


def test_canonical_definition_is_sorted_compact_json_with_periods_in_ms() -> None:
    policy = parse_policy("orders", ORDERS)
    assert canonical_definition(policy.algorithm, policy.selector, policy.windows) == (
        '{"algorithm":"fixed_window","selector":["user"],"windows":['
        '{"capacity":null,"limit":10,"name":"burst","period_ms":1000},'
        '{"capacity":null,"limit":1000,"name":"sustained","period_ms":3600000}]}'
    )


def test_canonical_definition_of_a_token_bucket_carries_effective_capacities() -> None:
    policy = parse_policy(
        "orders", orders(algorithm="token_bucket", selector=["ip", "user"], capacity={"burst": 20})
    )
    assert canonical_definition(policy.algorithm, policy.selector, policy.windows) == (
        '{"algorithm":"token_bucket","selector":["user","ip"],"windows":['
        '{"capacity":20,"limit":10,"name":"burst","period_ms":1000},'
        '{"capacity":1000,"limit":1000,"name":"sustained","period_ms":3600000}]}'
    )


def test_revision_is_first_8_hex_of_sha256_of_the_canonical_definition() -> None:
    policy = parse_policy("orders", ORDERS)
    canonical = canonical_definition(policy.algorithm, policy.selector, policy.windows)
    assert policy.revision == hashlib.sha256(canonical.encode()).hexdigest()[:8]
    assert policy.revision == "8151191e"
    assert settings_revision(policy.algorithm, policy.selector, policy.windows) == "8151191e"
    json.loads(canonical)


@pytest.mark.parametrize(
    "change",
    [
        {"enforcement": "shadow"},
        {"failure_mode": "open"},
        {"failure_mode": "closed"},
        {"routes": ["*"]},
        {"routes": ["/api"]},
        {"methods": ["POST"]},
        {"on_missing": "skip"},
        {"max_cost": 3},
        {"enabled": False},
    ],
)
def test_revision_ignores_what_does_not_change_a_counter(change: dict[str, Any]) -> None:
    assert (
        parse_policy("orders", orders(**change)).revision == parse_policy("orders", ORDERS).revision
    )


def test_revision_ignores_the_policy_id_and_source() -> None:
    base = parse_policy("orders", ORDERS).revision
    assert parse_policy("other", ORDERS).revision == base
    assert parse_policy("orders", ORDERS, source="database").revision == base


@pytest.mark.parametrize(
    "change",
    [
        {"algorithm": "sliding_window"},
        {"algorithm": "token_bucket"},
        {"selector": ["ip"]},
        {"selector": ["user", "ip"]},
        {"selector": ["auto"]},
        {"windows": {"short": "10/s", "sustained": "1000/h"}},
        {"windows": {"burst": "11/s", "sustained": "1000/h"}},
        {"windows": {"burst": "10/2s", "sustained": "1000/h"}},
        {"windows": {"burst": "10/s"}},
        {"windows": {"burst": "10/s", "sustained": "1000/h", "daily": "5000/d"}},
    ],
)
def test_revision_changes_with_what_a_counter_means(change: dict[str, Any]) -> None:
    assert (
        parse_policy("orders", orders(**change)).revision != parse_policy("orders", ORDERS).revision
    )


def test_revision_changes_with_token_bucket_capacity() -> None:
    bucket = orders(algorithm="token_bucket")
    base = parse_policy("orders", bucket).revision
    assert parse_policy("orders", {**bucket, "capacity": {"burst": 20}}).revision != base


def test_capacity_equal_to_limit_keeps_the_revision() -> None:
    bucket = orders(algorithm="token_bucket")
    base = parse_policy("orders", bucket).revision
    assert parse_policy("orders", {**bucket, "capacity": {"burst": 10}}).revision == base


def test_same_rate_written_differently_keeps_the_revision() -> None:
    first = parse_policy("orders", {"windows": {"w": "60/m"}})
    second = parse_policy("orders", {"windows": {"w": "60/60sec"}})
    assert first.revision == second.revision


def test_revision_is_eight_lower_case_hex_characters() -> None:
    revision = parse_policy("orders", ORDERS).revision
    assert len(revision) == 8
    assert set(revision) <= set("0123456789abcdef")


# -- generated ids -----------------------------------------------------------------------


def test_generated_id_is_lower_cased() -> None:
    assert generated_policy_id("view", "Shop.Views.OrderList") == "view:shop.views.orderlist"


def test_generated_id_replaces_other_characters_with_underscore() -> None:
    assert generated_policy_id("view", "app.views.<locals>.f") == "view:app.views._locals_.f"
    assert generated_policy_id("drf", "burst rate/2") == "drf:burst_rate_2"
    assert generated_policy_id("drf", "café") == "drf:caf_"


def test_generated_id_keeps_allowed_punctuation() -> None:
    assert generated_policy_id("drf", "a-b_c.d:e") == "drf:a-b_c.d:e"


def test_generated_id_of_64_characters_is_kept() -> None:
    name = "x" * 60
    assert generated_policy_id("drf", name) == "drf:" + name


def test_generated_id_over_64_characters_is_cut_to_55_dash_8_hex() -> None:
    result = generated_policy_id(
        "view",
        "MyProject.Views.Some Really/Long-Module.Name.SomeVeryLongClassName.dispatch<locals>",
    )
    cleaned = (
        "view:myproject.views.some_really_long-module.name.someverylongclassname.dispatch_locals_"
    )
    assert result == cleaned[:55] + "-" + hashlib.sha256(cleaned.encode()).hexdigest()[:8]
    assert result == "view:myproject.views.some_really_long-module.name.somev-e3593dbb"
    assert len(result) == 64


def test_generated_ids_sharing_a_long_prefix_stay_distinct() -> None:
    first = generated_policy_id("view", "a" * 70 + "1")
    second = generated_policy_id("view", "a" * 70 + "2")
    assert first != second
    assert first[:56] == second[:56]


@pytest.mark.parametrize("name", ["Shop.Views.Index", "x" * 200, "ü" * 80, "a b c"])
def test_generated_id_is_a_valid_policy_id(name: str) -> None:
    policy_id = generated_policy_id("view", name)
    assert parse_policy(policy_id, {"windows": "1/s"}).id == policy_id
